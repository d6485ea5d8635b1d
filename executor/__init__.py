"""Applies a plan.json to an nn.Module with torch.distributed (built in the executor issue)."""
