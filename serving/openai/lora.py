"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's), served only when the
operator allows runtime updates (--allow-runtime-lora-updating), behind the API key. An adapter
is read only from the directories named with --lora-dirs (the engine refuses any other path,
`..` and symlink escapes included, with a 400), and checked before it is registered."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from serving.openai.errors import APIError
from serving.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from serving.openai.state import ServerState

router = APIRouter()


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    state: ServerState = request.app.state.server
    async_engine, _ = state.ready()
    if body.lora_name == state.served_model_name:
        raise APIError(400, f"the name {body.lora_name!r} is the base model's", param="lora_name")
    engine = async_engine.engine
    await async_engine.run(lambda: engine.add_lora(body.lora_name, body.lora_path, restricted=True))
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(
    body: UnloadLoRAAdapterRequest, request: Request
) -> PlainTextResponse:
    state: ServerState = request.app.state.server
    async_engine, _ = state.ready()
    if body.lora_name not in async_engine.engine.list_loras():
        raise APIError(
            404, f"The LoRA adapter `{body.lora_name}` does not exist.", param="lora_name"
        )
    engine = async_engine.engine
    await async_engine.run(lambda: engine.remove_lora(body.lora_name))
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
