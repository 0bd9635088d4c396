"""gpemu.integrations"""
