"""Analysis of result files: gathering runs and sweeps into tables, the figures, and the
trace-replay simulator. Reads result files only; never loads a model."""
