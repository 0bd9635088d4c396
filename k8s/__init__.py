"""gpemu.k8s"""
