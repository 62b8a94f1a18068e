"""Drop a policy file here: every module in this folder is imported with `lab.scaling`, so its
`@register("name")` policies can be named in a config's modes without further wiring (see README,
"Add a scaling policy")."""
