package redirect

// IPTablesRestoreInput exposes the rendered rule text to the golden tests.
func IPTablesRestoreInput(f Family, o Options) string {
	return iptablesRules(f, o).restoreInput()
}
