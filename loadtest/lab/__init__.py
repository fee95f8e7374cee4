"""Experiments behind the benchmarks: one-off measurements that settled a design question.

``python -m loadtest.lab --help`` lists them. They may import ``loadtest.bench``; no
benchmark imports them. What each one found is in docs/lab/.
"""
