import trine as trio

with trio.ServiceClient() as service:
    trainer = service.create_lora_training_client(base_model="SmolLM2-135M-Instruct", rank=8)
    tok = trainer.get_tokenizer()
    prompt = trio.ModelInput.from_ints(tok.encode("Count: one, two,"))
    params = trio.SamplingParams(max_tokens=8, temperature=1.0)

    def datums_from(batch):
        """Reward: the share of digits in the reply; group-relative advantages."""
        texts = [s.text or "" for s in batch.sequences]
        rewards = [sum(c.isdigit() for c in t) / max(len(t), 1) for t in texts]
        mean = sum(rewards) / len(rewards)
        n = prompt.length - 1
        return [
            trio.Datum(
                model_input=trio.ModelInput.from_ints((prompt.to_ints() + s.tokens)[:-1]),
                loss_fn_inputs={
                    "target_tokens": [-100] * n + s.tokens,
                    "logprobs": [0.0] * n + s.logprobs,  # exact behaviour logprobs
                    "advantages": [0.0] * n + [r - mean] * len(s.tokens),
                },
            )
            for s, r in zip(batch.sequences, rewards)
            if s.tokens
        ]

    sampler = trainer.inflight_sampling_client()  # version 1
    pending = sampler.sample(prompt, num_samples=8, sampling_params=params)  # decodes while we train
    for step in range(3):
        batch, pending = pending.result(), sampler.sample(prompt, num_samples=8, sampling_params=params)
        print(step, [s.weights_versions for s in batch.sequences][:2])  # per token: which save
        trainer.forward_backward(datums_from(batch), "importance_sampling")
        trainer.optim_step(trio.AdamParams(learning_rate=1e-4))
        sampler = trainer.inflight_sampling_client()  # moves `pending` to new weights
    pending.result()
