"""The cost model: pure functions from (layer graph, cluster, workload, config) to time and memory.

compute.py   kernel times: GEMMs (tile and wave quantization, roofline), attention, memory-bound ops
layer.py     one layer under one parallel context: time, recompute, saved activations
memory.py    model states by runtime and ZeRO stage, in-flight micro-batches by schedule
step.py      a whole step: stages, pipeline schedule, data-parallel sync, optimizer -> Estimate
"""
