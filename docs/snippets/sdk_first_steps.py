import trine as trio

service = trio.ServiceClient()  # $TRINE_BASE_URL (default http://127.0.0.1:8000), $TRINE_API_KEY
trainer = service.create_lora_training_client(base_model="SmolLM2-135M-Instruct", rank=16)
tok = trainer.get_tokenizer()  # the served model's tokenizer (transformers), chat template included

ids = tok.apply_chat_template(
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}], return_dict=False
)
datum = trio.Datum(
    model_input=trio.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]}
)  # optional "weights": 0 masks a token

fb = trainer.forward_backward([datum], "cross_entropy")  # returns a future at once
opt = trainer.optim_step(trio.AdamParams(learning_rate=1e-4))  # queued behind it: same clock cycle
print(fb.result().metrics["loss_mean"], opt.result().metrics)

sampler = trainer.save_weights_and_get_sampling_client()
prompt = tok.apply_chat_template(
    [{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_dict=False
)
out = sampler.sample(
    trio.ModelInput.from_ints(prompt),
    num_samples=8,
    sampling_params=trio.SamplingParams(max_tokens=32, temperature=1.0),
).result()
for seq in out.sequences:
    print(seq.text, seq.logprobs)  # one logprob per sampled token
print(sampler.compute_logprobs(trio.ModelInput.from_ints(ids)).result())  # [None, lp1, lp2, ...]
print(out.usage)  # prefill, cached, sample tokens; cost
service.close()
