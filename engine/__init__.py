"""pdserve's shared inference core (see docs/design.md, "Inside the engine").

`engine` imports no other project folder. Heavy pieces load lazily so that the router can import
`engine.block_hash`, `engine.sampling_params` and the tokenizer without pulling in the model.
"""
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutput

__all__ = ["LLM", "SamplingParams", "StructuredOutput", "EngineConfig", "RequestOutput", "AsyncEngine", "LLMEngine"]


def __getattr__(name: str):
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    if name == "EngineConfig":
        from engine.config import EngineConfig
        return EngineConfig
    if name == "RequestOutput":
        from engine.outputs import RequestOutput
        return RequestOutput
    if name == "AsyncEngine":
        from engine.async_engine import AsyncEngine
        return AsyncEngine
    if name == "LLMEngine":
        from engine.engine import LLMEngine
        return LLMEngine
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
