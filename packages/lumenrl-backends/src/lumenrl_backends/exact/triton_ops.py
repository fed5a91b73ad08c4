"""placeholder"""
AVAILABLE = False
