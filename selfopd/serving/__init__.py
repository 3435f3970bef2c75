"""The vLLM side: engines over vLLM servers (`vllm`: the client, `vllm_answers`: what it reads) and vLLM in
the trainer's process (`colocate`), the servers themselves (`server`: launch, relaunch and stop; `ports`; `server_auth`,
`server_control`, `liveness`), which GPU does what (`gpu_layout`), the weight push into them (`weight_sync`,
the servers it reaches `push_membership`, its wire `transfer_wire`, the digests that prove it
`weight_digest`, and `vllm_worker`, which runs inside vLLM), and
`launch`: from a config's sections to the servers and engines of a run. It reads config sections
(`selfopd.config.bundles.ServingSettings`), never the whole `TrainConfig`, and knows nothing of losses.

vLLM servers import `selfopd.serving.vllm_worker` and `selfopd.serving.server_auth` by their dotted paths
(`--worker-extension-cls`, `--middleware`), so this file imports nothing."""
