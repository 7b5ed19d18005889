"""LocalRunner: evaluation runs in training's microbatches, so its logits fit where training's fit; each
microbatch runs inside the runner's forward context; both runners are a Runner."""

from __future__ import annotations

import contextlib

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from clustertrain.parallel.runner import LocalRunner
from clustertrain.model.loss import TokenLoss, token_loss_sum


def test_evaluation_forwards_one_microbatch_at_a_time_and_sums_them_all():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    rows_seen: list[int] = []
    model.register_forward_pre_hook(lambda _module, args, kwargs: rows_seen.append(kwargs["input_ids"].shape[0]),
                                    with_kwargs=True)
    ids = torch.randint(0, 100, (8, 12))
    labels = ids.clone()
    labels[:, :3] = -100  # rows of unequal loss: a mean per microbatch would differ from the sum
    labels[5, :9] = -100
    runner = LocalRunner(model, TokenLoss(), microbatches=4, device=torch.device("cpu"), autocast_dtype=None)
    with torch.no_grad():
        total = runner.eval_loss_sum({"input_ids": ids, "labels": labels})
        rows_seen_by_runner, rows_seen[:] = list(rows_seen), []
        whole = token_loss_sum(model, ids, labels)
    assert rows_seen_by_runner == [2, 2, 2, 2], "the logits of a rank's whole share must never exist at once"
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-5)


def test_both_runners_are_what_the_step_and_the_trainer_drive():
    """Runner declares every attribute and method the step, the evaluation and the trainer use of a runner."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from clustertrain.config.layout import resolve_layout
    from clustertrain.config.schema import ParallelConfig, RunConfig, TrainConfig
    from clustertrain.distributed.mesh import build_mesh
    from clustertrain.parallel.pp import PipelineRunner
    from clustertrain.parallel.runner import Runner
    from clustertrain.parallel.stages import build_stage

    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    cpu = torch.device("cpu")
    assert isinstance(LocalRunner(model, TokenLoss(), microbatches=2, device=cpu, autocast_dtype=None), Runner)
    parallel = ParallelConfig(pp=2)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)  # stage 0 of 2; nothing is sent
    try:
        mesh = build_mesh(resolve_layout(RunConfig(parallel=parallel, train=TrainConfig(steps=1)), 2), "cpu")
        runner = PipelineRunner([build_stage(model, 0, 2)], parallel, mesh, cpu, 2, TokenLoss(), None)
        assert isinstance(runner, Runner)
    finally:
        dist.destroy_process_group()


def test_a_runner_enters_its_forward_context_around_every_microbatch_forward_and_backward():
    """The hook context parallelism needs: each microbatch's forward and backward run inside the context, which is
    handed the very rows the model takes (torch's context_parallel shards them in place)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    events, given = [], []

    @contextlib.contextmanager
    def recording(rows: dict[str, torch.Tensor]):
        given.append(rows["input_ids"])
        events.append("enter")
        yield
        events.append("exit")

    model.register_forward_pre_hook(lambda _module, args, kwargs: events.append(
        "forward" if kwargs["input_ids"] is given[-1] else "forward of other rows"), with_kwargs=True)
    model.get_input_embeddings().weight.register_hook(lambda grad: events.append("backward"))
    runner = LocalRunner(model, TokenLoss(), microbatches=2, device=torch.device("cpu"), autocast_dtype=None,
                         forward_context=recording)
    ids = torch.randint(0, 100, (4, 12))
    batch = {"input_ids": ids, "labels": ids.clone()}
    runner.forward_backward(batch, torch.tensor(1.0))
    assert events == ["enter", "forward", "backward", "exit"] * 2
    assert [rows.shape[0] for rows in given] == [2, 2] and torch.equal(torch.cat(given), ids)
    events.clear()
    with torch.no_grad():
        runner.eval_loss_sum(batch)
    assert events == ["enter", "forward", "exit"] * 2
