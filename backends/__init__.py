"""ggraph.backends"""
