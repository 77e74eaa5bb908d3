"""xp.split_model: stages cut by module name hold what torch.distributed.pipelining's own split
puts in them; bad names are refused; ZB-V, DualPipeV and 1F1B from names train like one device
(mesh, float64); a stage that fails its probe gets the declare-activation advice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.pipelining import SplitPoint, pipeline

import xla_permute as xp
from xla_permute.pipeline.orders import stages_per_rank

N, VOCAB, DIM, SEQ, BATCH, BLOCKS = 4, 16, 8, 6, 2, 8


class Block(torch.nn.Module):
    """A residual block of the user's: LayerNorm, then an MLP; it unpacks its input's shape."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(DIM)
        self.up, self.down = torch.nn.Linear(DIM, 2 * DIM), torch.nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape  # what fails on token ids (the "not enough values to unpack")
        return x + self.down(torch.tanh(self.up(self.norm(x)))).reshape(b, s, d)


class Net(torch.nn.Module):
    """A user's language model: token ids ``(batch, seq)`` in, logits ``(batch, seq, vocab)``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
        self.norm = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))


def net() -> Net:
    """The same float64 model on every rank and on one device (from a generator of its own:
    the mesh's ranks are threads of one process, sharing torch's global one)."""
    model, g = Net().double(), torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) / 2)
    return model


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum")


def batch(micro_batches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``(M, batch, seq)`` and their next tokens."""
    k = torch.arange(micro_batches * BATCH * (SEQ + 1))
    ids = ((k * 2654435761) // 256 % VOCAB).reshape(micro_batches, BATCH, SEQ + 1)
    return ids[..., :-1].contiguous(), ids[..., 1:].contiguous()


def run(stages: torch.nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for stage in stages:
        x = stage(x)
    return x


def stage_names(model: torch.nn.Module, stage: torch.nn.Module) -> list[str]:
    """The model's names of a stage's parameters."""
    name = {id(p): n for n, p in model.named_parameters()}
    return sorted(name[id(p)] for p in stage.parameters())


SPLITS = {  # 1F1B on 4 ranks: 4 stages; ZB-V and DualPipeV: 8, two per rank in a V
    "1f1b": ["layers.2", "layers.4", "layers.6"],
    "zbv": [f"layers.{i}" for i in range(1, BLOCKS)],
    "dualpipev": [f"layers.{i}" for i in range(1, BLOCKS)],
}


@pytest.mark.filterwarnings("ignore:`torch.export.export_for_training` is deprecated")
@pytest.mark.parametrize(
    "spec",
    [
        {"layers.2": SplitPoint.BEGINNING, "layers.5": SplitPoint.BEGINNING},
        {"layers.1": SplitPoint.END, "layers.6": SplitPoint.END},
        {f"layers.{i}": SplitPoint.BEGINNING for i in range(1, BLOCKS)},
    ],
)
def test_stages_hold_what_torch_pipelining_puts_in_each(spec):
    model = net()
    tokens = batch(1)[0][0]
    pipe = pipeline(model, mb_args=(tokens,), split_spec=spec)  # PyTorch's own split
    stages = xp.split_model(model, spec)
    assert len(stages) == pipe.num_stages == len(spec) + 1
    for k, stage in enumerate(stages):
        theirs = sorted(n for n, _ in pipe.get_stage_module(k).named_parameters())
        assert stage_names(model, stage) == theirs
    with torch.no_grad():
        theirs = run([pipe.get_stage_module(k) for k in range(pipe.num_stages)], tokens)
        assert torch.equal(run(stages, tokens), model(tokens))
        assert torch.allclose(run(stages, tokens), theirs, rtol=1e-12)
    assert stage_names(model, stages[0])[0] == "embed.weight"  # the embedding opens stage 0
    assert "head.weight" in stage_names(model, stages[-1])  # the head closes the last


def test_names_and_split_spec_cut_alike():
    model = net()
    begins = xp.split_model(model, ["layers.2", "layers.7"])
    ends = xp.split_model(model, {"layers.1": SplitPoint.END, "layers.7": SplitPoint.BEGINNING})
    assert [stage_names(model, s) for s in begins] == [stage_names(model, s) for s in ends]
    whole = xp.split_model(model, [])
    assert len(whole) == 1 and stage_names(model, whole[0]) == sorted(
        n for n, _ in model.named_parameters()
    )


def test_hugging_face_llama_stages_are_its_forward_and_backward():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).double()
    stages = xp.split_model(model, ["model.layers.1", "model.layers.3"])
    assert stage_names(model, stages[0])[0] == "model.embed_tokens.weight"
    assert "lm_head.weight" in stage_names(model, stages[-1])
    tokens, targets = batch(1)
    logits = model(tokens[0]).logits
    loss_fn(logits, targets[0]).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got = run(stages, tokens[0])
    loss_fn(got, targets[0]).backward()
    assert torch.allclose(got, logits, rtol=1e-12, atol=1e-12)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, want[n], rtol=1e-10, atol=1e-12), n
    config._attn_implementation = "eager"  # causal only with the mask the stages do not pass
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        xp.split_model(model, ["model.layers.1"])


@pytest.mark.parametrize(
    ("points", "words"),
    [
        (["layers.9"], ["split_points ['layers.9']", "'layers.9' is none of them", "norm, head"]),
        (["model.layers.1"], ["'model.layers.1' is none of them"]),
        (["block.1"], ["'block.1' is none", ": embed, layers, norm, head"]),
        (["layers.4", "layers.2"], ["split_points", "in model order"]),
        (["layers.2", "layers.2"], ["once each"]),
        (["embed"], ["begin stages 1, 2, ...", "none empty"]),
        ({"head": SplitPoint.END}, ["none empty"]),
    ],
)
def test_bad_split_points_are_refused_by_name(points, words):
    with pytest.raises(ValueError, match="split_points") as caught:
        xp.split_model(net(), points)
    assert all(w in str(caught.value) for w in words), str(caught.value)


def test_one_name_is_one_split_point():
    model = net()
    one, listed = xp.split_model(model, "layers.4"), xp.split_model(model, ["layers.4"])
    assert [stage_names(model, s) for s in one] == [stage_names(model, s) for s in listed]


def test_a_hugging_face_name_without_its_prefix_is_pointed_at():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=DIM, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"'layers\.1' is none of them \('model\.layers\.1'\?\)"):
        xp.split_model(transformers.LlamaForCausalLM(config), ["layers.1"])


@pytest.mark.parametrize(
    ("schedule", "stages", "ranks", "result"),
    [
        ("1f1b", 4, 4, 1), ("zbv", 8, 4, 2), ("dualpipev", 8, 4, 2), ("interleaved", 12, 4, 3),
        ("zbv", 4, 4, "dualpipev"), ("1f1b", 8, 4, "1 per rank on 4 ranks: pass split_model 3"),
        ("zbv", 4, 4, "2 per rank on 4 ranks: pass split_model 7 split points"),
        ("interleaved", 6, 4, "split_model 3 split points .or 4 more, ...: a multiple of 4"),
    ],
)  # fmt: skip
def test_stage_count_is_checked_against_the_schedule(schedule, stages, ranks, result):
    if isinstance(result, int):
        assert stages_per_rank(schedule, stages, ranks) == result
        return
    if result == "dualpipev":  # a schedule object: its own count
        with pytest.raises(ValueError, match="modules holds 4 stages"):
            stages_per_rank(xp.make_schedule("dualpipev", 4, 8, 2), stages, ranks)
        return
    with pytest.raises(ValueError, match=f"modules holds {stages} stages.*{result}"):
        stages_per_rank(schedule, stages, ranks)


# On the mesh: one launch for the trainings and the advice


def reference(schedule_points: list[str], steps: int, micro_batches: int) -> dict:
    """One device: AdamW on the summed loss of the micro-batches, ``steps`` times."""
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    tokens, targets = batch(micro_batches)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = sum(loss_fn(model(x), t) for x, t in zip(tokens, targets, strict=True))
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return {"losses": losses, "params": {n: p.detach() for n, p in model.named_parameters()}}


def _error(call) -> str:
    try:
        call()
    except ValueError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def rank_trainings(runs: list[tuple[str, list[str], str | None]], steps: int, m: int) -> dict:
    """Each run: the model cut at its split points, ``steps`` AdamW steps of its schedule;
    then the three advice cases. Returns this rank's losses, its stages' parameters (by the
    model's names) and the error messages."""
    import torch_xla
    import torch_xla.runtime as xr

    device, rank = torch_xla.device(), xr.global_ordinal()
    tokens, targets = (t.to(device) for t in batch(m))
    out = []
    for schedule, points, activation in runs:
        model = net().to(device)
        stages = xp.split_model(model, points)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        losses = []
        for _ in range(steps):
            optimizer.zero_grad()
            step = xp.pipeline_step(
                stages, tokens, targets, loss_fn, schedule=schedule, activation=activation
            )
            optimizer.step()
            torch_xla.sync()
            losses.append(step.loss.cpu())
        mine = xp.make_schedule(schedule, N, m, stages_per_rank(schedule, len(stages), N))
        held = {id(p) for k in mine.stages_of(rank) for p in stages[k].parameters()}
        params = {n: p.detach().cpu() for n, p in model.named_parameters() if id(p) in held}
        out.append({"losses": losses, "params": params})
    model = net().to(device)
    stages = xp.split_model(model, SPLITS["1f1b"])

    def broken(x):  # a stage 0 that fails on the first micro-batch
        raise IndexError("index 99 is out of bounds for dimension 0 with size 16")

    errors = [
        _error(lambda: xp.pipeline_step(stages, tokens, targets, loss_fn)),  # left out
        _error(
            lambda: xp.pipeline_step(
                [broken] if rank == 0 else [stages[rank]],
                tokens,
                targets,
                loss_fn,
                activation="infer",
            )
        ),  # fmt: skip
        _error(
            lambda: xp.pipeline_step(
                stages, tokens, targets, loss_fn, activation=((BATCH, DIM), torch.float64)
            )
        ),
    ]
    return {"runs": out, "errors": errors}


RUNS = [("zbv", SPLITS["zbv"], "infer"),
        ("dualpipev", SPLITS["dualpipev"], ((BATCH, SEQ, DIM), torch.float64)),
        ("1f1b", SPLITS["1f1b"], "infer")]  # fmt: skip
STEPS, M = 3, 8


@pytest.fixture(scope="module")
def mesh() -> dict:
    return xp.run_on_mesh(rank_trainings, RUNS, STEPS, M, n=N)  # run_on_mesh's defaults


@pytest.mark.parametrize("i", range(len(RUNS)), ids=[r[0] for r in RUNS])
def test_split_by_names_trains_like_one_device(mesh, i):
    want = reference(RUNS[i][1], STEPS, M)
    losses = [sum(mesh[r]["runs"][i]["losses"][s] for r in range(N)) for s in range(STEPS)]
    assert torch.allclose(torch.stack(losses), torch.stack(want["losses"]), rtol=1e-10)
    seen = set()
    for r in range(N):
        for n, p in mesh[r]["runs"][i]["params"].items():
            assert torch.allclose(p, want["params"][n], rtol=1e-9, atol=1e-10), (r, n)
            seen.add(n)
    assert seen == set(want["params"])  # every parameter trained on some rank


def test_probe_advice(mesh):
    left_out, inferred, declared = zip(*(mesh[r]["errors"] for r in range(N)), strict=True)
    # activation left out with token ids (the case) or declared as one the blocks
    # cannot take: every rank's stages are probed before any collective; a block's own error
    # comes with the advice, and stage 0's wrong shape too
    for said in (left_out, declared):
        assert "stage module 0 (stage 0) returned shape (2, 6, 8)" in said[0], said[0]
        for r in range(1, N):
            assert (
                f"stage module 0 (stage {r}) raised ValueError (not enough values to "
                "unpack (expected 3, got 2)) for its input of shape" in said[r]
            ), said[r]
        assert all("activation=(shape, dtype)" in e for e in said)
    # 'infer' from a stage 0 that fails: its error, with the advice, on every rank alike
    assert len(set(inferred)) == 1
    assert "IndexError: index 99 is out of bounds" in inferred[0]
    assert "declare activation=(shape, dtype)" in inferred[0]
