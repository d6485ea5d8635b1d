"""meshplan's planner. ``planner.trace(module, example_inputs)`` traces an nn.Module (imported on
first use: planning a config model never imports torch)."""


def __getattr__(name: str):
    if name == "trace":
        import importlib
        return importlib.import_module(".trace", __name__)
    raise AttributeError(f"module 'planner' has no attribute {name!r}")
