"""Multi-LoRA serving (#24): adapters made by peft with random weights on tiny Llama and Qwen2
models, against transformers + peft (logits), against each request run alone (a batch mixing
the base model and several adapters), and through slot swaps while requests run (nothing
compiles, no request is lost)."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import jax
import numpy as np
import pytest

from engine.config import CacheConfig, LoRAConfig, SchedulerConfig
from engine.llm_engine import LLMEngine, run_to_completion
from engine.lora import LoRAError, check_allowed
from engine.models import registry
from engine.models.lora import LoRAInputs
from engine.request import SamplingParams
from engine.step import attention_metadata, forward_step
from engine.tokenizer import load_tokenizer
from engine.weights import open_checkpoint, resolve_model
from tests.engine.lora_adapters import (
    EXTRA,
    SPECS,
    AdapterSpec,
    peft_logits,
    write_adapter,
    write_adapters,
    write_model,
)

PAGE = 4
PROMPTS = [[256, *range(30 + 3 * i, 36 + 4 * i)] for i in range(5)]  # 7..11 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def make_engine(directory: Path, lora: LoRAConfig, *, warm_up: bool, **scheduler: int) -> LLMEngine:
    checkpoint = open_checkpoint(resolve_model(str(directory)))
    limits = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64) | scheduler
    return LLMEngine(
        checkpoint.cfg,
        checkpoint.load_params(),
        load_tokenizer(directory),
        cache_config=CacheConfig(page_size=PAGE, num_pages=256),
        scheduler_config=SchedulerConfig(**limits),
        warm_up=warm_up,
        lora_config=lora,
    )


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_and_adapters(request, tmp_path_factory):
    if request.param == "llama":  # the suite's LoRA checkpoint and adapters
        lora = request.getfixturevalue("lora")
        return lora.directory, lora.base, lora.adapters
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    base = write_model(request.param, root / "model")
    return root / "model", base, write_adapters(base, root / "adapters")


def all_token_logits(engine: LLMEngine, prompts: list[list[int]], adapters: list[str | None]):
    """Every prompt token's logits f32[T, V] per request, from one step that runs all the
    prompts together (each with its adapter), straight from the model."""
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters, strict=True)):
        engine.add_request(f"l{i}", prompt, GREEDY, lora_name=adapter)
    out = engine.scheduler.schedule()
    assert len(out.scheduled) == len(prompts)
    runner = engine.runner
    assert runner.lora is not None
    batch = runner.builder.build(out, engine.kv_cache, penalties=False)
    forward = jax.jit(forward_step, static_argnames="options")
    lora = LoRAInputs(runner.lora.weights, batch.lora_slots)
    result, _ = forward(
        runner.params, runner.kv_caches, batch.token_ids, batch.positions,
        attention_metadata(batch), batch.logits_indices, lora, options=runner.options(),
    )  # fmt: skip
    logits = np.asarray(registry.compute_logits(runner.params, result.hidden, cfg=engine.cfg))
    for i in range(len(prompts)):
        engine.abort_request(f"l{i}")
    bounds = np.cumsum([0, *(len(p) for p in prompts)])
    return [logits[a:b] for a, b in itertools.pairwise(bounds)]


def test_logits_match_transformers_peft(model_and_adapters) -> None:
    """Each adapter's logits at every prompt token, computed in one batch with the base model
    and the other adapters, within 1e-4 of transformers + peft with that adapter applied."""
    directory, base, adapters = model_and_adapters
    modules = tuple((n, str(p)) for n, p in adapters.items())
    lora = LoRAConfig(max_loras=4, max_lora_rank=16, modules=modules)
    engine = make_engine(directory, lora, warm_up=False)
    names: list[str | None] = [None, *adapters]
    ours = all_token_logits(engine, PROMPTS, names)
    base_logits = peft_logits(base, None, PROMPTS[0]).numpy()
    assert np.abs(base_logits).max() > 1.0
    for name, prompt, got in zip(names, PROMPTS, ours, strict=True):
        want = peft_logits(base, None if name is None else adapters[name], prompt).numpy()
        if name is not None:  # the adapter matters: a slot mix-up could not pass unseen
            plain = peft_logits(base, None, prompt).numpy()
            assert np.abs(want - plain).max() > 0.05, name
        print(f"{name}: max |logit difference| = {np.abs(got - want).max():.2e}")
        assert np.abs(got - want).max() <= 1e-4, (name, np.abs(got - want).max())


# ---- batching, swapping, compiling ---------------------------------------------------------


@pytest.fixture(scope="module")
def llama_adapters(lora):
    return lora.directory, lora.adapters, lora.extra


@pytest.fixture(scope="module")
def lora_engine(lora) -> LLMEngine:
    """The suite's warmed-up LoRA engine (tests/conftest.py), SPECS registered at start-up."""
    return lora.engine


def generate(
    engine: LLMEngine, jobs: list[tuple[list[int], str | None]], tag: str
) -> list[list[int]]:
    ids = [f"{tag}{i}" for i in range(len(jobs))]
    for request_id, (prompt, adapter) in zip(ids, jobs, strict=True):
        engine.add_request(request_id, prompt, GREEDY, lora_name=adapter)
    return [o.outputs[0].token_ids for o in run_to_completion(engine, ids)]


def test_mixed_batch_equals_each_alone(lora_engine) -> None:
    """The base model and four adapters in one batch: every request gets the greedy tokens it
    gets alone, and the adapters' outputs differ from the base model's."""
    jobs = list(zip(PROMPTS, [None, *SPECS], strict=True))
    # The process's count: other tests compile programs of their own after warm-up.
    compiled = lora_engine.stats().compilations_after_warm_up
    alone = [generate(lora_engine, [job], f"alone{i}-")[0] for i, job in enumerate(jobs)]
    mixed = generate(lora_engine, [(PROMPTS[0], name) for _, name in jobs], "same-")
    assert len(set(map(tuple, mixed))) > 1  # one prompt, five models: not all alike
    assert generate(lora_engine, jobs, "mixed-") == alone
    assert lora_engine.stats().compilations_after_warm_up == compiled


def test_swapping_adapters_while_running_compiles_nothing(lora_engine, llama_adapters) -> None:
    """Six adapters over four slots with requests of all of them queued at once: requests
    whose adapter has no slot wait without holding up the others, slots are rewritten as
    adapters go idle, an adapter is registered and another unregistered mid-run; every request
    finishes with its lone greedy tokens and nothing compiles."""
    _, _, extra = llama_adapters
    engine = lora_engine
    compiled = engine.stats().compilations_after_warm_up  # the process's: count this test's
    for name, path in extra.items():
        if name not in engine.list_loras():
            engine.add_lora(name, str(path))
    names = [*SPECS, *EXTRA]
    jobs = [(PROMPTS[i % len(PROMPTS)], names[i % len(names)]) for i in range(12)]
    jobs.append((PROMPTS[1], None))
    alone = {i: generate(engine, [job], f"solo{i}-")[0] for i, job in enumerate(jobs)}
    loads_before = engine.loras.num_loads if engine.loras else 0
    ids = [f"swap{i}" for i in range(len(jobs))]
    for request_id, (prompt, adapter) in zip(ids, jobs, strict=True):
        engine.add_request(request_id, prompt, GREEDY, lora_name=adapter)
    late = write_adapter_like(llama_adapters, "late", AdapterSpec(8, 8, ("v_proj",), seed=9))
    finished: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            finished.setdefault(output.request_id, []).extend(output.outputs[0].token_ids)
        steps += 1
        if steps == 2:
            engine.add_lora("late", str(late))  # registered while requests run
            engine.add_request("late0", PROMPTS[2], GREEDY, lora_name="late")
        if steps == 3:
            with pytest.raises(LoRAError, match="in use"):
                engine.remove_lora("late")
    assert [finished[i] for i in ids] == [alone[i] for i in range(len(jobs))]
    assert len(finished["late0"]) == GREEDY.max_tokens
    assert engine.loras is not None and engine.loras.num_loads - loads_before >= 3
    engine.remove_lora("extra-all-r4")  # idle now
    assert "extra-all-r4" not in engine.list_loras()
    assert engine.stats().compilations_after_warm_up == compiled


def write_adapter_like(llama_adapters, name: str, spec: AdapterSpec) -> Path:
    from tests.engine.lora_adapters import tiny_hf_model

    directory, _, _ = llama_adapters
    base = tiny_hf_model("llama")  # the same seed: the checkpoint's weights
    return write_adapter(base, spec, directory.parent / "late" / name)


# ---- metrics ---------------------------------------------------------------------------------


def test_lora_metrics_name_running_and_waiting_adapters(lora_engine, llama_adapters) -> None:
    """vLLM's lora_requests_info: requests of five adapters over four slots, queued at once.
    Before a step every one waits; once four are running (their prompts computed), the fifth
    adapter's request waits for a slot, since every slot is held by a running request; after
    they are aborted, none runs or waits. /metrics shows the same as labels, with max_lora."""
    from serving.openai.metrics import ServerMetrics
    from tests.serving.test_metrics import samples

    _, _, extra = llama_adapters
    engine = lora_engine
    fifth = "extra-q-r16"
    if fifth not in engine.list_loras():
        engine.add_lora(fifth, str(extra[fifth]))
    names = [*SPECS, fifth]
    assert engine.stats().max_loras == 4 and not engine.stats().running_lora_adapters
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ids = [f"metrics{i}" for i in range(len(names))]
    for request_id, name, prompt in zip(ids, names, PROMPTS, strict=True):
        engine.add_request(request_id, prompt, long, lora_name=name)
    stats = engine.stats()
    assert stats.waiting_lora_adapters == tuple(sorted((n, 1) for n in names))
    assert stats.running_lora_adapters == ()
    first_four = ids[:4]
    while any(engine.scheduler.get(r).num_computed_tokens < len(p) for r, p in zip(
            first_four, PROMPTS, strict=False)):  # fmt: skip
        engine.step()
    for _ in range(3):  # a few decode steps: the fifth still finds no free slot
        engine.step()
    stats = engine.stats()
    assert stats.running_lora_adapters == tuple(sorted((n, 1) for n in names[:4]))
    assert stats.waiting_lora_adapters == ((fifth, 1),)
    metrics = ServerMetrics(lambda: engine, "tiny")
    [labels] = samples(metrics, "xlaserve:lora_requests_info")
    assert dict(labels) == {
        "model_name": "tiny",
        "max_lora": "4",
        "running_lora_adapters": ",".join(sorted(names[:4])),
        "waiting_lora_adapters": fifth,
    }
    for request_id in ids:
        engine.abort_request(request_id)
    stats = engine.stats()
    assert stats.running_lora_adapters == stats.waiting_lora_adapters == ()
    assert engine.kv_cache.num_free_pages == engine.kv_cache.num_pages


# ---- prefix cache ----------------------------------------------------------------------------


def test_prefix_cache_pages_are_per_adapter(lora_engine) -> None:
    """On the allocator: a request of adapter A and one of adapter B with the same prompt never
    share a page; two requests of adapter A do (their full prompt pages)."""
    engine = lora_engine
    first, second = list(SPECS)[:2]
    prompt = [256, *range(60, 80)]  # 21 tokens: 5 full pages
    long = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    engine.add_request("pc-a1", prompt, long, lora_name=first)
    while engine.scheduler.get("pc-a1").num_computed_tokens < len(prompt):
        engine.step()  # its prefill (chunked): the prompt's pages go into the prefix cache
    engine.add_request("pc-a2", prompt, long, lora_name=first)
    engine.add_request("pc-b1", prompt, long, lora_name=second)
    engine.add_request("pc-base", prompt, long)
    rids = ("pc-a1", "pc-a2", "pc-b1", "pc-base")
    while any(engine.scheduler.get(r).num_computed_tokens < len(prompt) for r in rids):
        engine.step()
    tables = {rid: set(engine.kv_cache.page_table(rid)) for rid in rids}
    assert len(tables["pc-a1"] & tables["pc-a2"]) == 5  # the prompt's full pages, shared
    assert not tables["pc-a1"] & tables["pc-b1"]
    assert not tables["pc-a1"] & tables["pc-base"]
    assert not tables["pc-a2"] & tables["pc-b1"]
    assert not tables["pc-a2"] & tables["pc-base"]
    assert not tables["pc-b1"] & tables["pc-base"]
    requests = {rid: engine.scheduler.get(rid) for rid in tables}
    assert requests["pc-a2"].num_cached_tokens == 20  # its adapter's pages, found
    assert requests["pc-b1"].num_cached_tokens == 0
    assert requests["pc-base"].num_cached_tokens == 0
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv_cache.check_invariants()


# ---- bad adapters and paths --------------------------------------------------------------------


def _edit_config(directory: Path, **changes: object) -> None:
    import json

    path = directory / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_bad_adapters_are_refused_with_their_problem(lora_engine, llama_adapters, tmp_path) -> None:
    import shutil

    from tests.engine.lora_adapters import tiny_hf_model

    _, adapters, _ = llama_adapters
    engine = lora_engine
    base = tiny_hf_model("llama")
    big = write_adapter(base, AdapterSpec(32, 8, ("q_proj",)), tmp_path / "big")
    with pytest.raises(LoRAError, match="rank 32 is above the maximum LoRA rank 16"):
        engine.add_lora("big", str(big))
    wide = tiny_hf_model("llama", hidden_size=32, intermediate_size=48)
    other = write_adapter(wide, AdapterSpec(4, 8, ("q_proj",)), tmp_path / "other")
    with pytest.raises(LoRAError, match=r"lora_A \(4, 32\).*needs \(4, 64\)"):
        engine.add_lora("other", str(other))
    unknown = tmp_path / "unknown"
    shutil.copytree(adapters["qv-r4"], unknown)
    _edit_config(unknown, target_modules=["q_proj", "lm_head"])
    with pytest.raises(LoRAError, match="unknown target module 'lm_head'"):
        engine.add_lora("unknown", str(unknown))
    missing = tmp_path / "missing"
    missing.mkdir()
    shutil.copy(adapters["qv-r4"] / "adapter_config.json", missing)
    with pytest.raises(LoRAError, match=r"cannot read .*adapter_model\.safetensors"):
        engine.add_lora("missing", str(missing))
    with pytest.raises(LoRAError, match=r"cannot read .*adapter_config\.json"):
        engine.add_lora("nothing", str(tmp_path / "nowhere"))
    with pytest.raises(LoRAError, match="already in use"):
        engine.add_lora("qv-r4", str(adapters["qv-r4"]))
    assert not {"big", "other", "unknown", "missing", "nothing"} & set(engine.list_loras())
    out = generate(engine, [(PROMPTS[0], "qv-r4")], "still-")  # the engine keeps serving
    assert len(out[0]) == GREEDY.max_tokens


def test_allowed_dirs_refuse_escapes(tmp_path) -> None:
    allowed = tmp_path / "allowed"
    (allowed / "ok").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    assert check_allowed(str(allowed / "ok"), [str(allowed)]) == os.path.realpath(allowed / "ok")
    for bad in (outside, allowed / ".." / "outside", allowed / "ok" / ".." / ".." / "outside"):
        with pytest.raises(LoRAError, match="not inside the directories allowed"):
            check_allowed(str(bad), [str(allowed)])
    (allowed / "link").symlink_to(outside)
    with pytest.raises(LoRAError, match="not inside"):
        check_allowed(str(allowed / "link"), [str(allowed)])
