"""The demo recipe (demo.toml, what `make demo` runs) and its checks beyond its own eval."""
