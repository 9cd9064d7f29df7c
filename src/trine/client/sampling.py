"""SamplingClient: one sampling run (a base model, saved adapter weights fixed for its life, or a
training run's inflight weights, which move with its inflight saves).

`sample` and `compute_logprobs` validate their input at once (ValidationError), then return an
APIFuture; at most `max_samples_in_flight` requests per client are on the wire together. A retried
request reuses its request id, so the server can deduplicate it.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from ..errors import ActorAPIError, ValidationError
from ..types import ModelInput, PromptLogprobs, SampleResponse, SampleSequence, SamplingParams, Usage
from .futures import APIFuture
from .http import ActorConnection
from .runtime import UsageLedger
from .wire import model_input_to_wire, new_request_id

if TYPE_CHECKING:
    from .service import Session

_DEFAULT_PARAMS = SamplingParams()


def _check_prompt(prompt: ModelInput) -> None:
    if not isinstance(prompt, ModelInput):
        raise ValidationError(f"prompt must be a trine.ModelInput, got {type(prompt).__name__}")
    if prompt.is_empty:
        raise ValidationError("prompt is empty", code="validation.empty_prompt")
    for c in prompt.chunks:
        bad = [t for t in getattr(c, "tokens", ()) if t < 0]
        if bad:
            raise ValidationError(
                f"prompt token ids must be >= 0, got {bad[0]}", code="validation.token_id_out_of_range"
            )


class SamplingClient:
    def __init__(self, session: Session, run: dict):
        self._session = session
        self._rt = session.runtime
        self.sampling_run_id: str = run["sampling_run_cuid"]
        self.sampling_run_cuid = self.sampling_run_id
        self.model_id: str = run["model_id"]
        self.model_alias: str = run.get("model_alias") or run["model_id"]
        self._conn = ActorConnection(
            run["actor"],
            run["actor_jwt"],
            lambda: self._rt.control.call("POST", f"openapi/v1/sampling-runs/{self.sampling_run_id}/renew"),
            self._rt.settings,
            self._rt.actor_http,
        )
        self._slots: asyncio.Semaphore | None = None
        self._usage = UsageLedger(parent=self._rt.usage)

    def _request(
        self,
        prompt: ModelInput,
        num_samples: int,
        sampling_params: SamplingParams,
        include_prompt_logprobs: bool,
        topk_prompt_logprobs: int,
        return_text: bool,
        return_token_logprobs: bool,
    ) -> dict:
        _check_prompt(prompt)
        if not isinstance(sampling_params, SamplingParams):
            raise ValidationError(
                f"sampling_params must be a trine.SamplingParams, got {type(sampling_params).__name__}"
            )
        if sampling_params.max_tokens is None:
            raise ValidationError(
                "sampling_params.max_tokens must be set (> 0)", code="validation.invalid_sampling_request"
            )
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValidationError(f"num_samples must be an int >= 1, got {num_samples!r}")
        if not isinstance(topk_prompt_logprobs, int) or topk_prompt_logprobs < 0:
            raise ValidationError(f"topk_prompt_logprobs must be an int >= 0, got {topk_prompt_logprobs!r}")
        return {
            "request_id": new_request_id(),
            "prompt": model_input_to_wire(prompt, json=True),
            "sampling_params": sampling_params.to_wire(),
            "num_samples": num_samples,
            "return_text": return_text,
            "return_token_logprobs": return_token_logprobs,
            "return_prompt_logprobs": include_prompt_logprobs,
            "topk_prompt_logprobs": topk_prompt_logprobs,
        }

    async def _post(self, body: dict) -> dict:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._rt.settings.max_samples_in_flight)
        async with self._slots:
            r = await self._conn.request(
                "POST",
                f"v1/sampling-runs/{self.sampling_run_id}/sample",
                json=body,
                headers={"Accept": "application/json"},
                timeout=self._rt.settings.sampling_timeout_s,
            )
        if r.status_code >= 400:
            self._conn.raise_for_error(r, "sample")
        try:
            response = json.loads(r.content)
        except ValueError as e:
            raise ActorAPIError("the server's sample response is not JSON", code="invalid_response") from e
        if isinstance(response, dict) and response.get("code") and not response.get("sequences"):
            # an error after a 200 began (a server that could not break the response off): never
            # a success with no sequences
            raise ActorAPIError(
                str(response.get("message") or response["code"]), code=str(response["code"]), status_code=503
            )
        return response

    def _parse(self, response: dict) -> SampleResponse:
        usage_wire = response.get("usage") or {}
        usage = Usage.from_wire(usage_wire, cost=response.get("cost"))
        self._usage.add(usage)
        return SampleResponse(
            sequences=[
                SampleSequence(
                    tokens=s.get("tokens") or [],
                    text=s.get("text"),
                    logprobs=s.get("logprobs") or [],
                    stop_reason=s.get("stop_reason") or "",
                    weights_versions=s.get("weights_versions"),
                )
                for s in response.get("sequences") or []
            ],
            prompt_logprobs=response.get("prompt_logprobs") or [],
            topk_prompt_logprobs=response.get("topk_prompt_logprobs") or [],
            input_tokens=int(usage_wire.get("input_tokens") or 0),
            output_tokens=int(usage_wire.get("output_tokens") or 0),
            usage=usage,
        )

    def sample(
        self,
        prompt: ModelInput,
        num_samples: int = 1,
        sampling_params: SamplingParams = _DEFAULT_PARAMS,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        return_text: bool = True,
    ) -> APIFuture[SampleResponse]:
        """`num_samples` completions of `prompt` (they share one prefill). Each sequence has
        tokens, one logprob per token, text and stop_reason; `.usage` has tokens by phase."""
        body = self._request(
            prompt,
            num_samples,
            sampling_params,
            include_prompt_logprobs,
            topk_prompt_logprobs,
            return_text,
            True,
        )
        return APIFuture(self._rt.spawn(self._post(body))).map(self._parse)

    async def sample_async(
        self,
        prompt: ModelInput,
        num_samples: int = 1,
        sampling_params: SamplingParams = _DEFAULT_PARAMS,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        return_text: bool = True,
    ) -> SampleResponse:
        return await self.sample(
            prompt, num_samples, sampling_params, include_prompt_logprobs, topk_prompt_logprobs, return_text
        )

    def _parse_logprobs(self, response: dict) -> PromptLogprobs:
        parsed = self._parse(response)
        return PromptLogprobs(parsed.prompt_logprobs, usage=parsed.usage)

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture[PromptLogprobs]:
        """log p(token_i | tokens_<i) for every prompt position (entry 0 is None, and so is every
        entry whose token is an image's: an image token is no text prediction). Never served from
        the prefix cache."""
        body = self._request(prompt, 1, SamplingParams(max_tokens=1), True, 0, False, False)
        return APIFuture(self._rt.spawn(self._post(body))).map(self._parse_logprobs)

    async def compute_logprobs_async(self, prompt: ModelInput) -> PromptLogprobs:
        return await self.compute_logprobs(prompt)

    def get_tokenizer(self) -> Any:
        return self._session.get_tokenizer(self.model_id, self.model_alias)

    def usage(self) -> Usage:
        """Tokens by phase used by this client's finished requests."""
        return self._usage.total
