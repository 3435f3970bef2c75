"""Data: the published config.json values of the hub models the GPU recipes name, for the memory
planner offline (`selfopd.planning.published_configs` reads them; README.md names each file's source)."""
