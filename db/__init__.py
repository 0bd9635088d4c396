"""gpemu.db"""
