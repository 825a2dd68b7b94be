"""SamplingParams: how one request is decoded, validated on construction (ValueError on bad input)."""

from __future__ import annotations

from dataclasses import dataclass, field

_INT64_MAX = 2**63 - 1
MAX_N = 128  # more samples per request than this is a DoS vector (vLLM caps too)
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """What the output must match (vLLM's ``structured_outputs``): exactly one of a JSON schema (as
    canonical JSON text), a regular expression, a list of choices, an EBNF grammar, or any JSON object.

    The front end turns request fields into this and checks that it compiles; the engine compiles it
    (cached per distinct spec) and masks the logits of the request's rows with it.
    """

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [kind for kind in STRUCTURED_KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured outputs need exactly one of {', '.join(STRUCTURED_KINDS)}; got {given or 'none'}."
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured outputs `choice` must be a non-empty list of strings.")

    @property
    def kind(self) -> str:
        return next(kind for kind in STRUCTURED_KINDS if getattr(self, kind) not in (None, False))

    @property
    def key(self) -> tuple[str, object]:
        """Hashable identity of the spec: one compiled grammar per key."""
        return (self.kind, getattr(self, self.kind))


@dataclass(slots=True)
class SamplingParams:
    """Decoding parameters with vLLM's names, meanings and defaults.

    ``temperature == 0`` means greedy. ``top_k <= 0`` (0 or -1) disables top-k. ``max_tokens``
    None means "up to the context length". Stop strings are honoured by the front end
    (detokenizer); everything else by the engine.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per sampled token (0 = the chosen token only)
    prompt_logprobs: int | None = None  # same for prompt tokens
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # constrained decoding (grammar-masked logits)
    # locally typical sampling (TGI's typical_p): keep the tokens whose surprisal is closest to the
    # distribution's entropy until this much mass is kept; 1.0 = off; applied after top-k and top-p
    typical_p: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        _check_int("n", self.n, 1, MAX_N)
        _check_float("temperature", self.temperature, 0.0, None)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        _check_int("top_k", self.top_k, -1, None)
        if not 0.0 < self.typical_p <= 1.0:
            raise ValueError(f"typical_p must be in (0, 1], got {self.typical_p}.")
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, None)
        _check_int("min_tokens", self.min_tokens, 0, None)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        if self.seed is not None:
            _check_int("seed", self.seed, -(2**63), _INT64_MAX)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, None)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, None)
        for stop in self.stop:
            if not isinstance(stop, str) or not stop:
                raise ValueError("stop strings must be non-empty strings.")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, 0, None)
        if self.logit_bias:
            bad = [k for k in self.logit_bias if not isinstance(k, int) or isinstance(k, bool) or k < 0]
            if bad:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {bad}.")
            self.logit_bias = {k: max(-100.0, min(100.0, float(v))) for k, v in self.logit_bias.items()}

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def clone(self, **changes: object) -> SamplingParams:
        values = {name: getattr(self, name) for name in self.__dataclass_fields__}
        values.update(changes)
        return SamplingParams(**values)  # type: ignore[arg-type]


def _check_int(name: str, value: object, low: int | None, high: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}.")
    if low is not None and value < low:
        raise ValueError(f"{name} must be at least {low}, got {value}.")
    if high is not None and value > high:
        raise ValueError(f"{name} must be at most {high}, got {value}.")


def _check_float(name: str, value: object, low: float | None, high: float | None) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}.")
    if low is not None and value < low:
        raise ValueError(f"{name} must be at least {low}, got {value}.")
    if high is not None and value > high:
        raise ValueError(f"{name} must be at most {high}, got {value}.")
