"""Benchmarks: step time, memory, vLLM, precision, TRL, and the prepared GPU checks; results/ holds their JSON."""
