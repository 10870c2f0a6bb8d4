"""PEFT LoRA adapters with random weights for the tiny test models, written by `peft` itself
(adapter_config.json + adapter_model.safetensors), and the tiny models' HF checkpoints."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from tests.engine.tiny_model import EOS_ID, VOCAB_SIZE, write_byte_tokenizer

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterSpec:
    rank: int
    alpha: float
    targets: tuple[str, ...]
    rslora: bool = False
    seed: int = 0
    layers: tuple[int, ...] | None = field(default=None)  # None: every layer


# Several ranks, target sets, scalings; one rsLoRA, one on one layer only.
SPECS = {
    "qv-r4": AdapterSpec(4, 8, ("q_proj", "v_proj"), seed=1),
    "all-r8-rs": AdapterSpec(8, 16, ALL_TARGETS, rslora=True, seed=2),
    "mlp-o-r16": AdapterSpec(16, 4, ("o_proj", "gate_proj", "up_proj", "down_proj"), seed=3),
    "kd-r2": AdapterSpec(2, 2, ("k_proj", "down_proj"), seed=4, layers=(1,)),
}


def tiny_hf_model(kind: str, **overrides: object) -> torch.nn.Module:
    """A 2-layer random Llama or Qwen2 (biases on q/k/v, tied embeddings), hidden 64."""
    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
        bos_token_id=256,
        eos_token_id=EOS_ID,
    )
    common.update(overrides)
    if kind == "qwen2":
        config: transformers.PretrainedConfig = transformers.Qwen2Config(
            **common, tie_word_embeddings=True
        )
    else:
        config = transformers.LlamaConfig(**common)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


def write_model(kind: str, directory: Path, **overrides: object) -> torch.nn.Module:
    directory.mkdir(parents=True, exist_ok=True)
    model = tiny_hf_model(kind, **overrides)
    model.save_pretrained(directory)
    write_byte_tokenizer(directory)
    return model


def write_adapter(base: torch.nn.Module, spec: AdapterSpec, directory: Path) -> Path:
    """Wraps a copy of `base` with peft, fills the LoRA weights with random numbers (peft
    starts B at zero, which would make any adapter look right) and saves the adapter."""
    import copy

    import peft

    config = peft.LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=list(spec.targets),
        use_rslora=spec.rslora,
        lora_dropout=0.0,
        layers_to_transform=list(spec.layers) if spec.layers is not None else None,
    )
    model = peft.get_peft_model(copy.deepcopy(base), config)
    generator = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=generator))
    model.save_pretrained(directory)
    return directory


def write_adapters(base: torch.nn.Module, root: Path) -> dict[str, Path]:
    return {name: write_adapter(base, spec, root / name) for name, spec in SPECS.items()}


def peft_logits(base: torch.nn.Module, adapter: Path | None, ids: list[int]) -> torch.Tensor:
    """f32[T, V] logits of the prompt `ids` by transformers + peft with the adapter applied
    (the base model alone when `adapter` is None)."""
    import copy

    import peft

    model = base
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(copy.deepcopy(base), adapter)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


# Written beside SPECS but not registered at start-up (tests register them while serving).
EXTRA = {
    "extra-q-r16": AdapterSpec(16, 32, ("q_proj", "up_proj"), seed=5),
    "extra-all-r4": AdapterSpec(4, 4, ALL_TARGETS, seed=6),
}


@dataclass
class LoRASetup:
    """A tiny Llama checkpoint with peft adapters, and one warmed-up engine serving them (the
    suite shares it: warming up a LoRA engine is the slow part of these tests). Registered at
    start-up: SPECS, and `startup` (qv-r4's weights under another name); written only: EXTRA,
    and under `allowed` (the only directory adapters may be loaded from at runtime) `runtime`
    (all-r8-rs's weights) and `too-big` (rank 32)."""

    root: Path
    directory: Path  # the checkpoint
    base: torch.nn.Module
    adapters: dict[str, Path]  # SPECS
    extra: dict[str, Path]  # EXTRA
    engine: Any  # LLMEngine


def lora_setup(root: Path) -> LoRASetup:
    from engine.config import CacheConfig, LoRAConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine
    from engine.tokenizer import load_tokenizer
    from engine.weights import open_checkpoint, resolve_model

    directory = root / "model"
    base = write_model("llama", directory)
    adapters = write_adapters(base, root / "adapters")
    extra = {name: write_adapter(base, spec, root / "extra" / name) for name, spec in EXTRA.items()}
    write_adapter(base, SPECS["qv-r4"], root / "startup")
    write_adapter(base, SPECS["all-r8-rs"], root / "allowed" / "runtime")
    write_adapter(base, AdapterSpec(32, 8, ("q_proj",)), root / "allowed" / "too-big")
    modules = [(n, str(p)) for n, p in adapters.items()] + [("startup", str(root / "startup"))]
    lora = LoRAConfig(
        max_loras=4,
        max_lora_rank=16,
        max_cpu_loras=4,
        modules=tuple(modules),
        allowed_dirs=(str(root / "allowed"),),
        allow_runtime_updating=True,
    )
    checkpoint = open_checkpoint(resolve_model(str(directory)))
    # Small buckets (5 sequences, 8 tokens a step: 22 step variants), all compiled at once.
    engine = LLMEngine(
        checkpoint.cfg,
        checkpoint.load_params(),
        load_tokenizer(directory),
        cache_config=CacheConfig(page_size=4, num_pages=256),
        scheduler_config=SchedulerConfig(
            max_num_seqs=5, max_num_batched_tokens=8, max_model_len=64
        ),
        lora_config=lora,
    )
    return LoRASetup(root, directory, base, adapters, extra, engine)
