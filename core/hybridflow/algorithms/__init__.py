"""RL algorithms: drivers and the shared math.

The math (advantage estimators, losses, KL and Lagrange controllers) lives once in ``advantages``, ``losses`` and
``controllers``; each driver module is a short dataflow over worker groups that reads like its algorithm.
"""
