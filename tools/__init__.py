"""ggraph.tools"""
