"""Per-call state lives in the call's RiverCache: two threads generating on one river model at once (a small server
does exactly this) each get exactly the tokens and exit record they get alone."""

from __future__ import annotations

import threading

import torch

from river_hf import RiverConfig

from conftest import confidence_tau, river_of, tiny_model

ROUNDS = 6


def run(model, ids, config):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                         return_dict_in_generate=True)
    return out.sequences, out.cache.exit_depth


def test_two_threads_on_one_model_each_get_their_own_tokens():
    # The quantized LM head serves exited steps only: it must see its own thread's pass, not the other's.
    model = river_of(tiny_model(), start_layer=1, group_size=32, quantize_lm_head=True)
    torch.manual_seed(3)
    prompts = [torch.randint(3, 256, (1, 7)), torch.randint(3, 256, (1, 11))]
    tau = confidence_tau(model, prompts[0], max_new_tokens=16)
    configs = [RiverConfig(tau=tau, exit_signal="confidence", max_new_tokens=16, do_sample=False),
               RiverConfig(exit_signal="random", exit_rate=0.5, seed=7, max_new_tokens=16, do_sample=False)]
    alone = [run(model, ids, config) for ids, config in zip(prompts, configs)]
    for sequences, depths in alone:  # both exit patterns are mixed: the test can tell the calls apart
        assert len(depths[0, -16:].unique()) > 1

    results: list[list] = [[], []]
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def worker(index: int) -> None:
        try:
            start.wait()
            for _ in range(ROUNDS):
                results[index].append(run(model, prompts[index], configs[index]))
        except BaseException as error:  # noqa: BLE001 (re-raised in the main thread)
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for index in range(2):
        assert len(results[index]) == ROUNDS
        for sequences, depths in results[index]:
            assert torch.equal(sequences, alone[index][0])
            assert torch.equal(depths, alone[index][1])
