"""What one notebook alone compares against: its formulas, tables, replays and sweeps, one module per topic
(import the one you need, e.g. `from helpers.topics import moe`).

The rule (helpers/README.md, "Where a thing goes"): code the reader came to learn is in the notebook's cells;
rank programs are in helpers/programs/; what ONE notebook alone needs (its own rank program may import it too)
is here; what two or more notebooks, the trainer, or programs of several notebooks use stays at the top level
of helpers/ (memory accounting in helpers/memory/). A module here, like any library module, imports no program.
"""
