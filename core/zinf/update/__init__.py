"""zinf.update"""
