"""The application layer: what a user runs. Experiment planning and the run folder
(``rundir``), the command line, reports, comparisons, the method catalog, live progress and
experiment tracking. Imports every layer below; ``raysim.tuning`` sits above it."""
