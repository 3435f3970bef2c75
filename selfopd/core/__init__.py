"""What every stage stands on: atomic writes, fault points, devices and precision, torchrun, model folders, statistics, plots, the run-folder layout."""
