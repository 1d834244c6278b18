"""The suite's rank launches fork after a library has shown a progress bar in the pytest process.

``tests/_ranks.py`` forks ranks only from a process with one thread; a Hugging Face save or load
shows a tqdm bar, and tqdm's monitor thread would then outlive it, so every later launch would
spawn (each rank importing torch anew: about twice the time of the tests that start ranks).
``tests/conftest.py`` turns the monitor off; this test fails when it is on again.
"""

from __future__ import annotations

import os
import threading
import warnings

import pytest
import torch
from _ranks import start_method
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM


@pytest.mark.skipif("BYTESCALE_TEST_START_METHOD" in os.environ, reason="the start method is forced")
def test_a_hugging_face_save_and_load_leave_the_pytest_process_on_one_thread(tmp_path):
    config = LlamaConfig(
        vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
    )  # fmt: skip
    before = set(threading.enumerate())  # other tests' libraries may have left theirs (W&B's service)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    for thread in set(threading.enumerate()) - before:
        thread.join(timeout=10)  # transformers' loading pool shuts down without waiting: let it end
    assert [t.name for t in set(threading.enumerate()) - before] == []
    assert "tqdm_monitor" not in [t.name for t in threading.enumerate()]  # nor one an earlier test started
    if before == {threading.main_thread()}:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the fallback to spawn warns: here it must not happen
            assert start_method() == "fork"
