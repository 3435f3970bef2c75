"""The memory planner: how much GPU memory a run takes per GPU, from the models' config.json and the
layout, before anything loads (`memory_plan`: the trainer's parts, `server_memory`: a vLLM server's,
`memory_fit`: the run's plan and its one-line refusal), the published configs it reads offline
(`published_configs`, `model_configs/`), the check `selfopd train` makes on GPUs (`plan_check`), and
what each 'auto' setting becomes on a machine (`auto_settings`, for `--show-config`). It serves
`selfopd plan`, `--show-config` and that check only, and reads config sections
(`selfopd.config.bundles.PlanSettings`), never the whole `TrainConfig`."""
