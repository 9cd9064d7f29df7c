"""The sampler: prefix-cached KV blocks, fair admission and chunked prefill, token sampling, stops and prompt
scores; `sampler.Sampler` runs the step loop."""
