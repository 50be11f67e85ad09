"""The agent and structured-output clients, unchanged, against a live server (tiny random backbone):
instructor's default mode (a named tool call), langchain-openai's bind_tools and
with_structured_output, openai-agents with its chat-completions model and with its default
Responses model, each running a tool. The grammar makes the tiny model's calls valid; what they
say is random."""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.server.api.openai.test_tools import long_backbone
from tests.support.server_fixtures import build_store, live_server, settings_for

openai = pytest.importorskip("openai")


class Weather(BaseModel):
    """The weather in a city."""

    # additionalProperties false: a random model's extra keys would be allowed, and run on
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=10)
    unit: Literal["c", "f"]
    degrees: int = Field(ge=-50, le=50)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("clients")
    build_store(root / "store")
    with live_server(settings_for(root, max_new_tokens=256, max_prompt_tokens=1700), long_backbone()) as srv:
        yield srv


def test_instructor_default_mode(server):
    instructor = pytest.importorskip("instructor")
    client = instructor.from_openai(openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0))
    assert client.mode == instructor.Mode.TOOLS  # its default: tools + a named tool_choice
    for model in ("base", "alpha"):
        weather = client.chat.completions.create(model=model, response_model=Weather, max_retries=0, max_tokens=256,
                                                 temperature=0,
                                                 messages=[{"role": "user", "content": "weather in Oslo?"}])
        assert isinstance(weather, Weather)


def test_langchain_bind_tools_and_structured_output(server):
    pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    class City(BaseModel):
        model_config = ConfigDict(extra="forbid")
        city: str = Field(max_length=10)  # bounded: a random model may never close a string

    @tool(args_schema=City)
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="base", max_tokens=256, temperature=0,
                     max_retries=0)
    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("weather in Oslo?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str)
    required = llm.bind_tools([get_weather], tool_choice="any", parallel_tool_calls=False).invoke("weather?")
    assert [c["name"] for c in required.tool_calls] == ["get_weather"]
    for method in ("json_schema", "function_calling"):
        weather = llm.with_structured_output(Weather, method=method).invoke("weather in Oslo?")
        assert isinstance(weather, Weather)


@pytest.mark.parametrize("kind", ["chat_completions", "responses"])
def test_openai_agents_run_a_tool(server, kind):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: Annotated[str, Field(max_length=10)]) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    if kind == "chat_completions":
        model = agents.OpenAIChatCompletionsModel(model="base", openai_client=client)
    else:
        model = agents.OpenAIResponsesModel(model="base", openai_client=client)
    # the tool's result is the answer: a random model's free text after it rarely ends before max tokens
    agent = agents.Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather], model=model,
                         tool_use_behavior="stop_on_first_tool",
                         model_settings=agents.ModelSettings(tool_choice="get_weather", max_tokens=200, temperature=0))
    result = asyncio.run(agents.Runner.run(agent, "weather in Oslo?", max_turns=2))
    assert len(calls) == 1 and len(calls[0]) <= 10
    assert result.final_output == "sunny"
