"""Simulators: the real router, or its admission check, against simulated workers; no model, no GPU.

``scheduler_sim`` (a discrete-time simulator of the admission policies, no Redis), ``scale_sim`` (the real router
against N simulated worker processes), ``router_bench`` (the router alone: admission decisions and dispatches a
second), ``fair_sim`` (priorities and fair shares, two tenants) and ``preempt_sim`` (``fair_sim``'s priority figure
with preempt and resume).
"""
