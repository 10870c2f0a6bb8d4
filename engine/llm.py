"""The offline API, in the spirit of vLLM's `LLM`:

llm = LLM("smollm2-135m")
outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.builder import build_engine
from engine.config import CompilationConfig, EngineConfig
from engine.llm_engine import run_to_completion
from engine.lora import LoRARequest
from engine.protocol import Engine
from engine.request import RequestOutput, SamplingParams


class LLM:
    """`LLM(model, **fields)` takes EngineConfig's fields (`dtype`, `quantization`, `cache`,
    `scheduler`, `parallel`, `compilation`; buckets compile on first use unless `compilation`
    says otherwise); `LLM(config=EngineConfig(...))` a whole config."""

    def __init__(
        self, model: str = "smollm2-135m", *, config: EngineConfig | None = None, **fields: Any
    ):
        if config is None:
            fields.setdefault("compilation", CompilationConfig(warm_up="lazy"))
            config = EngineConfig(model=model, **fields)
        elif fields:
            raise TypeError("give either config or EngineConfig fields, not both")
        self.engine: Engine = build_engine(config)

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt; returns finished outputs in the order of `prompts`.
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base
        model); an adapter not seen before is registered from its path first."""
        prompt_list: list[str | Sequence[int]] = (
            [prompts] if isinstance(prompts, str) else list(prompts)
        )
        params = sampling_params or SamplingParams()
        params_list = (
            [params] * len(prompt_list) if isinstance(params, SamplingParams) else list(params)
        )
        loras = (
            list(lora_request)
            if isinstance(lora_request, Sequence)
            else [lora_request] * len(prompt_list)
        )
        ids = [f"offline-{i}" for i in range(len(prompt_list))]
        for request_id, prompt, p, lora in zip(ids, prompt_list, params_list, loras, strict=True):
            name = None if lora is None else self._register(lora)
            self.engine.add_request(request_id, prompt, p, lora_name=name)
        return run_to_completion(self.engine, ids, use_tqdm=use_tqdm)

    def _register(self, lora: LoRARequest) -> str:
        if lora.lora_name not in self.engine.list_loras():
            self.engine.add_lora(lora.lora_name, lora.lora_path)
        return lora.lora_name
