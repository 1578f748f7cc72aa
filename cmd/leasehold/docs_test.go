package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/leasehold/leasehold/testing/natstest"
)

// docCommand is one leasehold command line that the README or a guide
// shows: in a ```sh block (a command to run) or in inline code in the
// prose (a reference, which may name a command without its arguments).
type docCommand struct {
	where  string   // file:line
	args   []string // after the program's name
	inline bool
}

func (c docCommand) String() string {
	return c.where + ": leasehold " + strings.Join(c.args, " ")
}

// guides are the README and every guide under docs/.
func guides(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob("../../docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatal("no guides under docs/")
	}
	return append([]string{"../../README.md"}, files...)
}

// Every leasehold command line in the README and the guides names
// subcommands and flags that exist, with the arguments the command takes:
// a guide that names a flag that is gone fails here, not in a reader's
// terminal.
func TestGuidesNameRealCommandsAndFlags(t *testing.T) {
	root := newRoot()
	blocks, inline := 0, 0
	for _, file := range guides(t) {
		text, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range docCommands(filepath.Base(file), string(text)) {
			if c.inline {
				inline++
			} else {
				blocks++
			}
			if err := checkCommand(root, c); err != nil {
				t.Errorf("%s\n\t%v", c, err)
			}
		}
	}
	// A parser that finds nothing would pass anything.
	if blocks < 40 || inline < 20 {
		t.Fatalf("found %d command lines in sh blocks and %d in inline code: the parser has lost them", blocks, inline)
	}
	t.Logf("checked %d command lines in sh blocks and %d in inline code", blocks, inline)
}

// The checker itself: it must refuse what is wrong, or the test above
// proves nothing.
func TestCheckCommandRefuses(t *testing.T) {
	root := newRoot()
	md := "```sh\n" +
		"./leasehold worker --partitions 4 --no-such-flag\n" + // a flag that does not exist
		"./leasehold wroker --partitions 4\n" + // a subcommand that does not exist
		"./leasehold dlq lst\n" + // a misspelt subcommand
		"./leasehold status --json extra\n" + // an argument status does not take
		"./leasehold enqueue --partitions\n" + // a flag without its value
		"./leasehold sink ls --kv-bucket x -z\n" + // an unknown shorthand
		"```\n" +
		"Prose with `leasehold fence --lokc NAME` in it.\n"
	cmds := docCommands("bad.md", md)
	if len(cmds) != 7 {
		t.Fatalf("found %d commands in the bad guide, want 7: %v", len(cmds), cmds)
	}
	for _, c := range cmds {
		if err := checkCommand(root, c); err == nil {
			t.Errorf("%s passed the check", c)
		} else {
			t.Logf("%s: %v", c, err)
		}
	}
	good := docCommands("good.md", "```sh\n"+
		"FOO=1 ./leasehold enqueue --kind email '{\"To\": \"a b\"}' -n 2   # a comment --not-a-flag\n"+
		"kill -STOP $(cat alice.pid); sleep 15; ./leasehold status --json\n"+
		"go build -o leasehold ./cmd/leasehold && ./leasehold bench --quick\n"+
		"go run ./cmd/leasehold demo --workers=4\n"+
		"```\nand `leasehold enqueue --at|--in`.\n")
	if len(good) != 5 {
		t.Fatalf("found %d commands in the good guide, want 5: %v", len(good), good)
	}
	for _, c := range good {
		if err := checkCommand(root, c); err != nil {
			t.Errorf("%s: %v", c, err)
		}
	}
}

var (
	fenceRE  = regexp.MustCompile("(?ms)^```([a-z]*)\\n(.*?)^```")
	inlineRE = regexp.MustCompile("`([^`]+)`")
)

// docCommands finds the leasehold command lines of a Markdown text.
func docCommands(file, text string) []docCommand {
	var out []docCommand
	lineOf := func(off int) string { return fmt.Sprintf("%s:%d", file, strings.Count(text[:off], "\n")+1) }
	prose := []byte(text)
	for _, m := range fenceRE.FindAllStringSubmatchIndex(text, -1) {
		for i := m[0]; i < m[1]; i++ {
			if prose[i] != '\n' {
				prose[i] = ' ' // inline code is looked for outside the blocks
			}
		}
		if text[m[2]:m[3]] != "sh" {
			continue
		}
		body, start := text[m[4]:m[5]], m[4]
		lines := strings.Split(strings.ReplaceAll(body, "\\\n", "  "), "\n")
		off := start
		for _, line := range lines {
			for _, seg := range shellSegments(line) {
				if args, ok := leaseholdArgs(seg); ok {
					out = append(out, docCommand{where: lineOf(off), args: args})
				}
			}
			off += len(line) + 1
		}
	}
	for _, m := range inlineRE.FindAllSubmatchIndex(prose, -1) {
		code := strings.Join(strings.Fields(string(prose[m[2]:m[3]])), " ")
		if args, ok := leaseholdArgs(shellWords(code)); ok && len(args) > 0 {
			out = append(out, docCommand{where: lineOf(m[0]), args: args, inline: true})
		}
	}
	return out
}

// shellSegments splits a shell line into the words of each simple command
// (at ;, &&, ||, | and &), without its comment.
func shellSegments(line string) [][]string {
	var (
		segs  [][]string
		words []string
		word  strings.Builder
		inW   bool
		quote byte
		depth int // inside $( )
	)
	flushWord := func() {
		if inW {
			words = append(words, word.String())
			word.Reset()
			inW = false
		}
	}
	flushSeg := func() {
		flushWord()
		if len(words) > 0 {
			segs = append(segs, words)
		}
		words = nil
	}
	for i := 0; i < len(line); i++ {
		c := line[i]
		switch {
		case quote != 0:
			if c == quote {
				quote = 0
			} else {
				word.WriteByte(c)
			}
		case c == '\'' || c == '"':
			quote, inW = c, true
		case c == '$' && i+1 < len(line) && line[i+1] == '(':
			depth++
			word.WriteString("$(")
			inW = true
			i++
		case depth > 0:
			if c == ')' {
				depth--
			}
			word.WriteByte(c)
		case c == '#' && !inW:
			flushSeg()
			return segs
		case c == ' ' || c == '\t':
			flushWord()
		case c == ';' || c == '|' || c == '&':
			flushSeg()
		default:
			word.WriteByte(c)
			inW = true
		}
	}
	flushSeg()
	return segs
}

func shellWords(s string) []string {
	segs := shellSegments(s)
	if len(segs) == 0 {
		return nil
	}
	return segs[0]
}

// leaseholdArgs returns the arguments of words if they run the leasehold
// command: leasehold, ./leasehold, $bin/leasehold or go run ./cmd/leasehold,
// after any VAR=value assignments.
func leaseholdArgs(words []string) ([]string, bool) {
	for len(words) > 0 && regexp.MustCompile(`^[A-Z_][A-Z0-9_]*=`).MatchString(words[0]) {
		words = words[1:]
	}
	switch {
	case len(words) == 0:
		return nil, false
	case words[0] == "leasehold" || words[0] == "./leasehold" || strings.HasSuffix(words[0], "/leasehold") && !strings.HasPrefix(words[0], "./cmd"):
		return words[1:], true
	case len(words) >= 3 && words[0] == "go" && words[1] == "run" && words[2] == "./cmd/leasehold":
		return words[3:], true
	}
	return nil, false
}

// checkCommand walks c's arguments down the command tree: each word that
// names a subcommand descends, each flag must be defined on the command
// reached (or inherited), a flag that takes a value must have one, and a
// command line (not a reference in prose) must reach a runnable command
// with arguments it accepts.
func checkCommand(root *cobra.Command, c docCommand) error {
	cmd, args := root, c.args
	var positional []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		switch {
		case a == "--":
			positional = append(positional, args[i+1:]...)
			i = len(args)
		case strings.HasPrefix(a, "-") && a != "-":
			for _, part := range strings.Split(a, "|") { // --at|--in in prose
				name, _, hasValue := strings.Cut(strings.TrimLeft(part, "-"), "=")
				var f *pflag.Flag
				if strings.HasPrefix(part, "--") {
					f = lookupFlag(cmd, name)
				} else if len(name) == 1 {
					f = lookupShorthand(cmd, name)
				}
				if f == nil {
					return fmt.Errorf("%q has no flag %s (see `%s --help`)", cmd.CommandPath(), part, cmd.CommandPath())
				}
				if !hasValue && f.NoOptDefVal == "" && !strings.Contains(a, "|") {
					if i+1 >= len(args) {
						if c.inline {
							break // prose may name a flag without its value
						}
						return fmt.Errorf("flag %s of %q needs a value", part, cmd.CommandPath())
					}
					i++
				}
			}
		default:
			if len(positional) == 0 {
				if sub := findSub(cmd, a); sub != nil {
					cmd = sub
					continue
				}
				if !cmd.Runnable() {
					return fmt.Errorf("%q has no subcommand %q", cmd.CommandPath(), a)
				}
			}
			positional = append(positional, a)
		}
	}
	if c.inline {
		if len(positional) > 0 && !cmd.Runnable() {
			return fmt.Errorf("%q has no subcommand %q", cmd.CommandPath(), positional[0])
		}
		return nil
	}
	if !cmd.Runnable() {
		if len(positional) > 0 {
			return fmt.Errorf("%q has no subcommand %q", cmd.CommandPath(), positional[0])
		}
		return fmt.Errorf("%q needs a subcommand", cmd.CommandPath())
	}
	if err := cmd.ValidateArgs(positional); err != nil {
		return fmt.Errorf("%q: %v", cmd.CommandPath(), err)
	}
	return nil
}

func findSub(cmd *cobra.Command, name string) *cobra.Command {
	for _, sub := range cmd.Commands() {
		if sub.Name() == name || sub.HasAlias(name) {
			return sub
		}
	}
	return nil
}

func lookupFlag(cmd *cobra.Command, name string) *pflag.Flag {
	if f := cmd.Flags().Lookup(name); f != nil {
		return f
	}
	return cmd.InheritedFlags().Lookup(name)
}

func lookupShorthand(cmd *cobra.Command, s string) *pflag.Flag {
	if f := cmd.Flags().ShorthandLookup(s); f != nil {
		return f
	}
	return cmd.InheritedFlags().ShorthandLookup(s)
}

// Every $(cat FILE) in a guide reads a file some command of that guide
// writes with --pid-file: the freeze commands signal the worker they name.
func TestGuidesSignalWorkersByTheirPIDFiles(t *testing.T) {
	catRE := regexp.MustCompile(`\$\(cat ([^)]+)\)`)
	for _, file := range guides(t) {
		text, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		written := map[string]bool{}
		for _, c := range docCommands(filepath.Base(file), string(text)) {
			for i, a := range c.args {
				if v, ok := strings.CutPrefix(a, "--pid-file="); ok {
					written[v] = true
				} else if a == "--pid-file" && i+1 < len(c.args) {
					written[c.args[i+1]] = true
				}
			}
		}
		for _, m := range catRE.FindAllStringSubmatch(string(text), -1) {
			if !written[m[1]] {
				t.Errorf("%s reads %s, which no command of it writes with --pid-file", file, m[1])
			}
		}
		if strings.Contains(string(text), "pgrep") {
			t.Errorf("%s finds processes with pgrep: name them with --pid-file", file)
		}
	}
}

// The tutorial's command lines run, in its order, against an embedded
// server: init, two workers and a sink (in the background, as in their
// terminals), enqueue, status and sink ls; then status shows both workers
// holding partitions and the sink holds effects. What cannot run here as
// written is adapted, and only that: --nats points at the test's server,
// --http at free loopback ports, --pid-file into a temporary directory,
// and --rate is dropped (15 jobs a second would make the test wait). The
// lines that signal processes (kill) and the NATS server's own are not run.
func TestTutorialCommandsRun(t *testing.T) {
	if testing.Short() {
		t.Skip("runs two workers and a sink")
	}
	text, err := os.ReadFile("../../docs/tutorial.md")
	if err != nil {
		t.Fatal(err)
	}
	s := natstest.Start(t, natstest.Listen())
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	adapt := func(args []string) []string {
		var out []string
		for i := 0; i < len(args); i++ {
			switch args[i] {
			case "--http":
				i++
				out = append(out, "--http", freeAddr(t))
			case "--pid-file":
				i++
				out = append(out, "--pid-file", filepath.Join(dir, args[i]))
			case "--rate":
				i++
			default:
				out = append(out, args[i])
			}
		}
		return append(out, "--nats", s.URL())
	}
	ran := map[string]int{}
	for _, c := range docCommands("tutorial.md", string(text)) {
		if c.inline || len(c.args) == 0 {
			continue
		}
		args := adapt(c.args)
		switch c.args[0] {
		case "worker", "sink":
			if len(c.args) > 1 && !strings.HasPrefix(c.args[1], "-") {
				break // sink ls: below
			}
			background(t, append(args, "--log-level", "warn")...)
			ran[c.args[0]]++
			continue
		case "demo":
			continue // TestDemo runs it
		}
		out, err := runEventually(t, ctx, c.args, args)
		if err != nil {
			t.Fatalf("%s: %v\n%s", c, err, out)
		}
		ran[c.args[0]]++
		t.Logf("%s:\n%s", c, out)
	}
	for _, want := range []string{"init", "worker", "sink", "enqueue", "status"} {
		if ran[want] == 0 {
			t.Errorf("the tutorial ran no %s command", want)
		}
	}
	// Both workers show up as holders once they have balanced.
	for {
		out, err := run(t, ctx, "status", "--nats", s.URL())
		if err == nil && strings.Contains(out, "alice") && strings.Contains(out, "bob") {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("status never showed alice and bob holding partitions: %v\n%s", err, out)
		}
		time.Sleep(100 * time.Millisecond)
	}
	for _, w := range []string{"alice", "bob"} {
		if pid, err := os.ReadFile(filepath.Join(dir, w+".pid")); err != nil || strings.TrimSpace(string(pid)) != fmt.Sprint(os.Getpid()) {
			t.Errorf("%s.pid holds %q, %v; want this process's ID", w, pid, err)
		}
	}
}

// runEventually runs a tutorial line; sink ls waits for the sink to have
// created its bucket and applied an effect, as a reader who runs it after
// the enqueue would find.
func runEventually(t *testing.T, ctx context.Context, doc, args []string) (string, error) {
	for {
		out, err := run(t, ctx, args...)
		if len(doc) < 2 || doc[0] != "sink" || doc[1] != "ls" {
			return out, err
		}
		if err == nil && strings.Contains(out, "leasehold.") {
			return out, nil
		}
		if ctx.Err() != nil {
			return out, fmt.Errorf("the sink never listed an effect: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Every relative link of the README and the guides leads to a file that
// exists, and every #anchor to a heading of its page (GitHub's slugs).
func TestGuidesLinksResolve(t *testing.T) {
	linkRE := regexp.MustCompile(`\]\(([^)\s]+)\)`)
	headingRE := regexp.MustCompile(`(?m)^#+ (.+)$`)
	slug := func(h string) string {
		var b strings.Builder
		for _, r := range strings.ToLower(strings.ReplaceAll(h, "`", "")) {
			switch {
			case r == ' ':
				b.WriteByte('-')
			case r == '-' || r == '_' || r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r > 127 && r != '…' && r != '—':
				b.WriteRune(r)
			}
		}
		return b.String()
	}
	anchors := func(file string) map[string]bool {
		text, err := os.ReadFile(file)
		if err != nil {
			return nil
		}
		set := map[string]bool{}
		for _, m := range headingRE.FindAllStringSubmatch(fenceRE.ReplaceAllString(string(text), ""), -1) {
			set[slug(m[1])] = true
		}
		return set
	}
	links := 0
	for _, file := range guides(t) {
		text, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range linkRE.FindAllStringSubmatch(string(text), -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			links++
			path, anchor, _ := strings.Cut(target, "#")
			dest := file
			if path != "" {
				dest = filepath.Join(filepath.Dir(file), path)
				if _, err := os.Stat(dest); err != nil {
					t.Errorf("%s links to %s, which does not exist", file, target)
					continue
				}
			}
			if anchor != "" && !anchors(dest)[anchor] {
				t.Errorf("%s links to %s: %s has no heading with that anchor", file, target, dest)
			}
		}
	}
	if links < 30 {
		t.Fatalf("found %d relative links: the parser has lost them", links)
	}
}
