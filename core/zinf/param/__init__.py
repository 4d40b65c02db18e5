"""zinf.param"""
