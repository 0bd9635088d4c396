"""gpemu.profiler"""
