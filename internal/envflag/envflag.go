// Package envflag lets every command-line flag also be set from an
// environment variable named INPOD_<FLAG>, the convention of every inpod
// binary, and documents both in --help. A flag given on the command line wins
// over its variable.
package envflag

import (
	"flag"
	"fmt"
	"os"
	"strings"
)

// Prefix starts every variable name.
const Prefix = "INPOD_"

// EnvName is the variable for a flag: "ack-timeout" → INPOD_ACK_TIMEOUT.
func EnvName(flagName string) string {
	return Prefix + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

// Parse parses args, then fills every flag not set on the command line from
// its variable. summary is the first line of --help.
func Parse(fs *flag.FlagSet, summary string, args []string) error {
	fs.Usage = func() { usage(fs, summary) }
	if err := fs.Parse(args); err != nil {
		return err
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	var err error
	fs.VisitAll(func(f *flag.Flag) {
		if err != nil || set[f.Name] {
			return
		}
		v, ok := os.LookupEnv(EnvName(f.Name))
		if !ok {
			return
		}
		if e := fs.Set(f.Name, v); e != nil {
			err = fmt.Errorf("invalid value %q for %s (flag --%s): %v", v, EnvName(f.Name), f.Name, e)
		}
	})
	return err
}

func usage(fs *flag.FlagSet, summary string) {
	out := fs.Output()
	fmt.Fprintf(out, "%s\n\nUsage: %s [flags]\n\nEvery flag can also be set by the environment variable shown; the flag wins.\n\n", summary, fs.Name())
	fs.VisitAll(func(f *flag.Flag) {
		name, help := flag.UnquoteUsage(f)
		fmt.Fprintf(out, "  --%s %s\t[$%s]\n", f.Name, name, EnvName(f.Name))
		fmt.Fprintf(out, "      %s", help)
		if f.DefValue != "" && f.DefValue != "false" {
			fmt.Fprintf(out, " (default %s)", f.DefValue)
		}
		fmt.Fprintln(out)
	})
}
