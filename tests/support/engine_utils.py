"""Helpers for tests that drive the native engine directly: submit, wait, read one request's
events back per choice (and check that every choice got exactly one final event)."""

from __future__ import annotations

from dataclasses import dataclass, field

from server.engines.request import FinalEvent, GenRequest, SamplingParams, TokenEvent, TokenLogprob


@dataclass
class Choice:
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)  # every token's, in order (when asked)
    events: list[TokenEvent] = field(default_factory=list)
    final: FinalEvent | None = None

    @property
    def tokens(self) -> list[int]:
        """Generated token ids (needs logprobs to be asked for: every token is reported there)."""
        return [lp.token_id for lp in self.logprobs]

    @property
    def key(self) -> tuple:
        """What must match between two runs of the same request."""
        f = self.final
        assert f is not None
        return (self.text, self.tokens, f.finish_reason, f.completion_tokens, f.error)


def choices(req: GenRequest) -> list[Choice]:
    """The request's events grouped per choice; asserts exactly one final per choice, last."""
    out = [Choice() for _ in range(req.params.n)]
    for event in req.handle.events:
        c = out[event.index]
        assert c.final is None, f"event after the final event of choice {event.index}"
        c.text += event.text
        c.logprobs += event.logprobs or []
        if isinstance(event, FinalEvent):
            c.final = event
        else:
            c.events.append(event)
    missing = [i for i, c in enumerate(out) if c.final is None]
    assert not missing, f"choices without a final event: {missing}"
    return out


def submit(engine, tok, prompt: str | list[int], params: SamplingParams, adapter=None) -> GenRequest:
    ids = prompt if isinstance(prompt, list) else list(tok(prompt, add_special_tokens=False).input_ids)
    return engine.submit(GenRequest(ids, params, adapter))


def wait_all(reqs: list[GenRequest], timeout: float = 30.0) -> list[list[Choice]]:
    for r in reqs:
        assert r.handle.wait(timeout), f"request {r.id} got no final event within {timeout}s"
    return [choices(r) for r in reqs]


def run(engine, tok, prompt, params: SamplingParams, adapter=None) -> list[Choice]:
    return wait_all([submit(engine, tok, prompt, params, adapter)])[0]
