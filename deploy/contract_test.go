package deploy

import (
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"
)

// The command line the deployment files call: the flags of each leasehold
// command as the CLI contract states them, copied here so that a flag used
// in a manifest or in docker-compose.yml that the command lacks fails the
// tests. The command must keep these names.
type flagKind int

const (
	kindString flagKind = iota
	kindInt
	kindDuration
	kindBool
	kindAddr // host:port, host optional
)

type flagSpec struct {
	kind flagKind
	def  string   // the contract's default, "" when it has none
	one  []string // allowed values, nil for any
}

// connectionFlags are taken by every command that talks to NATS, with the
// environment variables the nats CLI uses.
var connectionFlags = map[string]flagSpec{
	"nats":     {kind: kindString, def: "nats://127.0.0.1:4222"},
	"user":     {kind: kindString},
	"password": {kind: kindString},
	"nkey":     {kind: kindString},
	"creds":    {kind: kindString},
	"tls-cert": {kind: kindString},
	"tls-key":  {kind: kindString},
	"tls-ca":   {kind: kindString},
	"prefix":   {kind: kindString, def: "leasehold"},
	"bucket":   {kind: kindString, def: "leasehold-leases"},
	"config":   {kind: kindString},
}

// commandFlags are each command's own flags.
var commandFlags = map[string]map[string]flagSpec{
	"demo": {
		"duration":   {kind: kindDuration, def: "60s"},
		"workers":    {kind: kindInt, def: "3"},
		"partitions": {kind: kindInt, def: "16"},
		"jobs":       {kind: kindInt},
		"otlp":       {kind: kindString},
		"json":       {kind: kindBool},
	},
	"init": {
		"partitions": {kind: kindInt, def: "16"},
		"replicas":   {kind: kindInt, def: "1"},
		"marker-ttl": {kind: kindDuration, def: "1m"},
	},
	"worker": {
		"partitions":    {kind: kindInt, def: "16"},
		"worker-id":     {kind: kindString},
		"ttl":           {kind: kindDuration, def: "10s"},
		"drain-timeout": {kind: kindDuration, def: "20s"},
		"concurrency":   {kind: kindInt},
		"http":          {kind: kindAddr, def: ":8080"},
		"work-time":     {kind: kindDuration},
		"write-behind":  {kind: kindBool},
		"otlp":          {kind: kindString},
	},
	"sink": {
		"kind":          {kind: kindString, one: []string{"kv", "stream", "postgres"}},
		"postgres-url":  {kind: kindString},
		"kv-bucket":     {kind: kindString},
		"downstream":    {kind: kindString},
		"verify-epochs": {kind: kindBool},
		"http":          {kind: kindAddr, def: ":8081"},
	},
	"status": {"json": {kind: kindBool}},
	"fence":  {},
	"chaos": {
		"duration": {kind: kindDuration},
		"cluster":  {kind: kindBool},
		"json":     {kind: kindBool},
	},
	"bench": {
		"quick": {kind: kindBool},
		"json":  {kind: kindBool},
	},
}

// contractEnv are the environment variables the command reads: the nats
// CLI's names for the connection, LEASEHOLD_ + flag name for the rest, and
// DATABASE_URL for --postgres-url.
func contractEnv() map[string]bool {
	env := map[string]bool{
		"NATS_URL": true, "NATS_USER": true, "NATS_PASSWORD": true, "NATS_NKEY": true,
		"NATS_CREDS": true, "NATS_CERT": true, "NATS_KEY": true, "NATS_CA": true,
		"LEASEHOLD_PREFIX": true, "LEASEHOLD_BUCKET": true, "LEASEHOLD_CONFIG": true,
		"DATABASE_URL": true,
	}
	for _, flags := range commandFlags {
		for name := range flags {
			env["LEASEHOLD_"+strings.ToUpper(strings.ReplaceAll(name, "-", "_"))] = true
		}
	}
	return env
}

// libraryEnv are variables the deployment files set for libraries and the
// runtime the command links (OpenTelemetry's SDK and exporter, Go), and
// POD_NAME, which Kubernetes expands into --worker-id.
var libraryEnv = map[string]bool{
	"OTEL_EXPORTER_OTLP_ENDPOINT": true,
	"OTEL_SERVICE_NAME":           true,
	"GOMEMLIMIT":                  true,
	"POD_NAME":                    true,
}

// invocation is a parsed leasehold command line.
type invocation struct {
	command string
	flags   map[string]string // long name -> value ("true" for a bare bool)
	args    []string          // positional arguments
}

// parseInvocation checks args (what follows the binary's name) against the
// contract: a known command, known flags with values of the right kind.
func parseInvocation(args []string) (invocation, error) {
	if len(args) == 0 {
		return invocation{}, fmt.Errorf("no command: the image's entrypoint is the leasehold binary, so args must start with a command")
	}
	inv := invocation{command: args[0], flags: map[string]string{}}
	own, ok := commandFlags[inv.command]
	if !ok {
		return inv, fmt.Errorf("unknown command %q", inv.command)
	}
	for i := 1; i < len(args); i++ {
		a := args[i]
		if !strings.HasPrefix(a, "--") {
			if strings.HasPrefix(a, "-") {
				return inv, fmt.Errorf("%s: use long flags (--name) in deployment files", a)
			}
			inv.args = append(inv.args, a)
			continue
		}
		name, value, hasValue := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		spec, ok := own[name]
		if !ok && inv.command != "demo" { // demo embeds its own server
			spec, ok = connectionFlags[name]
		}
		if !ok {
			return inv, fmt.Errorf("leasehold %s has no flag --%s", inv.command, name)
		}
		if !hasValue {
			if spec.kind == kindBool {
				value = "true"
			} else {
				if i+1 >= len(args) {
					return inv, fmt.Errorf("--%s needs a value", name)
				}
				i++
				value = args[i]
			}
		}
		if _, dup := inv.flags[name]; dup {
			return inv, fmt.Errorf("--%s given twice", name)
		}
		if err := spec.check(value); err != nil {
			return inv, fmt.Errorf("--%s=%s: %w", name, value, err)
		}
		inv.flags[name] = value
	}
	return inv, nil
}

func (s flagSpec) check(v string) error {
	if strings.Contains(v, "$(") {
		return nil // expanded by Kubernetes; checked where it is defined
	}
	switch s.kind {
	case kindInt:
		if _, err := strconv.Atoi(v); err != nil {
			return fmt.Errorf("not an integer")
		}
	case kindDuration:
		if _, err := time.ParseDuration(v); err != nil {
			return fmt.Errorf("not a duration: %w", err)
		}
	case kindBool:
		if _, err := strconv.ParseBool(v); err != nil {
			return fmt.Errorf("not a boolean")
		}
	case kindAddr:
		if _, port, err := net.SplitHostPort(v); err != nil || port == "" {
			return fmt.Errorf("not a host:port address")
		}
	}
	if s.one != nil {
		for _, o := range s.one {
			if v == o {
				return nil
			}
		}
		return fmt.Errorf("use one of %v", s.one)
	}
	return nil
}

// value is the flag's value, or the contract's default.
func (inv invocation) value(name string) string {
	if v, ok := inv.flags[name]; ok {
		return v
	}
	if s, ok := commandFlags[inv.command][name]; ok {
		return s.def
	}
	return connectionFlags[name].def
}

func (inv invocation) duration(name string) time.Duration {
	d, _ := time.ParseDuration(inv.value(name))
	return d
}

// drainTimeout bounds the graceful shutdown: --drain-timeout where the
// command has it, else the contract's default of 20s.
func (inv invocation) drainTimeout() time.Duration {
	if _, ok := commandFlags[inv.command]["drain-timeout"]; ok {
		return inv.duration("drain-timeout")
	}
	d, _ := time.ParseDuration(commandFlags["worker"]["drain-timeout"].def)
	return d
}

func (inv invocation) int(name string) int {
	n, _ := strconv.Atoi(inv.value(name))
	return n
}

// httpPort is the port of --http.
func (inv invocation) httpPort() int {
	_, port, _ := net.SplitHostPort(inv.value("http"))
	n, _ := strconv.Atoi(port)
	return n
}
