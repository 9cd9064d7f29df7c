import random

import trine as trio

with trio.ServiceClient() as service:  # closing ends the session's runs
    trainer = service.create_lora_training_client(
        base_model="SmolLM2-135M-Instruct", rank=16, name="grpo-arith", tags=["grpo"]
    )
    tok = trainer.get_tokenizer()
    params = trio.SamplingParams(max_tokens=8, temperature=1.0, stop=["<|im_end|>", "\n"])
    for step in range(1, 11):
        sampler = trainer.save_weights_and_get_sampling_client()  # a sampler on the current weights
        a, b = random.randint(1, 30), random.randint(1, 30)
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": f"What is {a} + {b}?"}],
            add_generation_prompt=True,
            return_dict=False,
        )
        group = sampler.sample(
            trio.ModelInput.from_ints(prompt), num_samples=8, sampling_params=params
        ).result()
        rewards = [1.0 if str(a + b) in (seq.text or "") else 0.0 for seq in group.sequences]
        mean = sum(rewards) / len(rewards)
        n = len(prompt) - 1  # prompt positions: not trained
        data = [
            trio.Datum(
                model_input=trio.ModelInput.from_ints((prompt + seq.tokens)[:-1]),
                loss_fn_inputs={
                    "target_tokens": [-100] * n + seq.tokens,  # -100: no target
                    "logprobs": [0.0] * n + seq.logprobs,  # the sampler's own
                    "advantages": [0.0] * n + [r - mean] * len(seq.tokens),
                },
            )
            for seq, r in zip(group.sequences, rewards)
            if seq.tokens
        ]
        fb = trainer.forward_backward(data, "importance_sampling")
        trainer.optim_step(trio.AdamParams(learning_rate=1e-3)).result()
        trainer.log_metrics({"reward": mean}, step=step)  # plotted on the console
        print(step, mean, fb.result().metrics["loss_mean"])
