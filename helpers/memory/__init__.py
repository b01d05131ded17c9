"""Memory accounting, one home per idea (import the module you need, e.g. `from helpers.memory import planner`):

formulas     the ZeRO paper's model-state bytes, Korthikanti et al.'s activation bytes, GPT-2/GPT-3 shapes
             (pure arithmetic, no torch at import time)
measured     what a rank really holds (by component, by side), peak memory from the allocator or the OS,
             ZeRO settings that make a tiny model's bytes show the formulas
planner      what fits on a GPU (stage, offload, checkpointing, micro-batch), the explorer's checks and config
widget       the explorer as ipywidgets
budget       will a run fit? its memory estimated before it starts, against what is free (refused or warned)

Notebook 05's own experiments (the activation sweep, the ZeRO-Offload and 16-bit runs) are in helpers.topics.
"""
