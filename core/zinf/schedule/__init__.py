"""zinf.schedule"""
