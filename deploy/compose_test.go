package deploy

import (
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// compose is the part of the Compose file format that docker-compose.yml
// uses. Decoding is strict, so a misspelt key fails here rather than being
// ignored (or rejected only on a machine with Docker).
type compose struct {
	Name       string                    `json:"name"`
	XLeasehold *composeService           `json:"x-leasehold"` // YAML anchor, merged into services
	Services   map[string]composeService `json:"services"`
	Volumes    map[string]*struct{}      `json:"volumes"`
}

type composeService struct {
	Image string `json:"image"`
	Build *struct {
		Context    string `json:"context"`
		Dockerfile string `json:"dockerfile"`
	} `json:"build"`
	Entrypoint  []string          `json:"entrypoint"`
	Command     []string          `json:"command"`
	Environment map[string]string `json:"environment"`
	Ports       []string          `json:"ports"`
	Volumes     []string          `json:"volumes"`
	DependsOn   map[string]struct {
		Condition string `json:"condition"`
	} `json:"depends_on"`
	Healthcheck *struct {
		Test     []string `json:"test"`
		Interval string   `json:"interval"`
		Timeout  string   `json:"timeout"`
		Retries  int      `json:"retries"`
	} `json:"healthcheck"`
	Restart         string   `json:"restart"`
	StopGracePeriod string   `json:"stop_grace_period"`
	User            string   `json:"user"`
	ReadOnly        bool     `json:"read_only"`
	CapDrop         []string `json:"cap_drop"`
	SecurityOpt     []string `json:"security_opt"`
	Tmpfs           []string `json:"tmpfs"`
	Profiles        []string `json:"profiles"`
}

func decodeCompose(b []byte) (compose, error) {
	var c compose
	err := unmarshalStrict(b, &c)
	return c, err
}

func loadCompose(t *testing.T) compose {
	t.Helper()
	c, err := decodeCompose(readFile(t, "docker-compose.yml"))
	if err != nil {
		t.Fatalf("docker-compose.yml: %v", err)
	}
	return c
}

func TestComposeMisspeltKeyFails(t *testing.T) {
	t.Parallel()
	b := readFile(t, "docker-compose.yml")
	for _, c := range []struct{ old, new string }{
		{"stop_grace_period: 30s", "stop_grace_periods: 30s"},
		{"depends_on:", "depend_on:"},
		{"read_only: true", "readonly: true"},
	} {
		if _, err := decodeCompose(mutate(t, b, c.old, c.new)); err == nil {
			t.Errorf("%q decoded without error", c.new)
		} else {
			t.Logf("rejected as it should be: %v", err)
		}
	}
}

// composeVar is a Compose interpolation with a default: ${NAME:-default}.
var composeVar = regexp.MustCompile(`^\$\{([A-Z_][A-Z0-9_]*):-[^}]*\}$`)

func TestCompose(t *testing.T) {
	c := loadCompose(t)
	svc := c.Services
	for _, name := range []string{"nats", "jaeger", "postgres", "init", "sink"} {
		if _, ok := svc[name]; !ok {
			t.Fatalf("no %s service", name)
		}
	}

	// Every published port is on the loopback interface.
	for name, s := range svc {
		for _, p := range s.Ports {
			if !strings.HasPrefix(p, "127.0.0.1:") {
				t.Errorf("%s: port %s is published on every interface; bind it to 127.0.0.1", name, p)
			}
		}
		for dep := range s.DependsOn {
			if _, ok := svc[dep]; !ok {
				t.Errorf("%s depends on %s, which is not a service", name, dep)
			}
		}
	}

	// Jaeger v2, OTLP on 4317 and 4318, the UI on 16686.
	if j := svc["jaeger"]; !strings.HasPrefix(j.Image, "jaegertracing/jaeger:2") {
		t.Errorf("jaeger image %s, want jaegertracing/jaeger:2.x (the OpenTelemetry-based Jaeger)", j.Image)
	} else {
		for _, port := range []string{"4317", "4318", "16686"} {
			if !slices.Contains(j.Ports, "127.0.0.1:"+port+":"+port) {
				t.Errorf("jaeger does not publish %s on 127.0.0.1", port)
			}
		}
	}

	// NATS runs the configuration in nats/, which has JetStream and syncs
	// every write.
	n := svc["nats"]
	var confTarget string
	for _, v := range n.Volumes {
		if src, dst, ok := strings.Cut(v, ":"); ok && src == "./nats/nats-server.conf" {
			confTarget, _, _ = strings.Cut(dst, ":")
		}
	}
	if confTarget == "" || !slices.Contains(n.Command, confTarget) {
		t.Errorf("nats does not run ./nats/nats-server.conf (volumes %v, command %v)", n.Volumes, n.Command)
	}
	setPasswords(t)
	opts, err := server.ProcessConfigFile(filepath.FromSlash("nats/nats-server.conf"))
	if err != nil {
		t.Fatalf("nats/nats-server.conf: %v", err)
	}
	if !opts.JetStream || !opts.SyncAlways {
		t.Errorf("nats/nats-server.conf: jetstream %v, sync_interval always %v; want both", opts.JetStream, opts.SyncAlways)
	}
	users := map[string]bool{}
	for _, u := range opts.Users {
		users[u.Username] = true
	}

	initPartitions := 0
	if inv, err := parseInvocation(svc["init"].Command); err == nil && inv.command == "init" {
		initPartitions = inv.int("partitions")
	} else {
		t.Errorf("the init service does not run `leasehold init`: %v", err)
	}
	workerIDs := map[string]string{}
	known := contractEnv()
	for name, s := range svc {
		if !isLeaseholdImage(s.Image) {
			continue
		}
		t.Run(name, func(t *testing.T) {
			if s.Build == nil || s.Build.Dockerfile != "Dockerfile" {
				t.Errorf("not built from the root Dockerfile (build %+v)", s.Build)
			} else if _, err := os.Stat(filepath.Join(filepath.FromSlash(s.Build.Context), s.Build.Dockerfile)); err != nil {
				t.Errorf("build context %s: %v", s.Build.Context, err)
			}
			if s.User == "" || strings.HasPrefix(s.User, "0") || strings.HasPrefix(s.User, "root") {
				t.Errorf("user %q: run as non-root", s.User)
			}
			if !s.ReadOnly || !slices.Contains(s.CapDrop, "ALL") {
				t.Errorf("read_only %v, cap_drop %v: want a read-only root and no capabilities", s.ReadOnly, s.CapDrop)
			}
			inv, err := parseInvocation(s.Command)
			if err != nil {
				t.Fatalf("command %v: %v", s.Command, err)
			}
			for k := range s.Environment {
				if !known[k] && !libraryEnv[k] {
					t.Errorf("environment %s: the leasehold command does not read it", k)
				}
			}
			// The service's NATS user exists, with the password the NATS
			// container gives it.
			user := s.Environment["NATS_USER"]
			if !users[user] {
				t.Errorf("NATS_USER %q is not a user of nats/nats-server.conf", user)
			}
			serverSide := n.Environment[strings.ToUpper(user)+"_PASSWORD"]
			if got := s.Environment["NATS_PASSWORD"]; got == "" || got != serverSide || !composeVar.MatchString(got) {
				t.Errorf("NATS_PASSWORD %q: want the same ${VAR:-default} the nats service sets as %s_PASSWORD (%q)", got, strings.ToUpper(user), serverSide)
			}
			if u, err := parseNATSURL(s.Environment["NATS_URL"]); err != nil || u != "nats" {
				t.Errorf("NATS_URL %q: want the nats service", s.Environment["NATS_URL"])
			}

			switch inv.command {
			case "init":
				if inv.int("replicas") != 1 {
					t.Errorf("--replicas=%d on a single server", inv.int("replicas"))
				}
			case "worker", "sink":
				if d := s.DependsOn["init"]; d.Condition != "service_completed_successfully" {
					t.Errorf("must wait for init to complete (depends_on init: %q)", d.Condition)
				}
				grace, err := time.ParseDuration(s.StopGracePeriod)
				if err != nil || grace <= inv.drainTimeout() {
					t.Errorf("stop_grace_period %q is not above the drain timeout %v: docker would kill it mid-drain", s.StopGracePeriod, inv.drainTimeout())
				}
				port := strconv.Itoa(inv.httpPort())
				if !slices.ContainsFunc(s.Ports, func(p string) bool { return strings.HasSuffix(p, ":"+port) }) {
					t.Errorf("--http port %s is not published", port)
				}
				if got := s.Environment["OTEL_EXPORTER_OTLP_ENDPOINT"]; got != "http://jaeger:4318" {
					t.Errorf("OTEL_EXPORTER_OTLP_ENDPOINT %q, want Jaeger's OTLP/HTTP port http://jaeger:4318", got)
				}
			}
			if inv.command == "worker" {
				id := inv.value("worker-id")
				if other, dup := workerIDs[id]; dup {
					t.Errorf("--worker-id=%s is also %s's", id, other)
				}
				workerIDs[id] = name
				if p := inv.int("partitions"); p != initPartitions {
					t.Errorf("--partitions=%d, and init provisions %d", p, initPartitions)
				}
			}
			if inv.command == "sink" && inv.value("kind") == "postgres" {
				if s.Environment["DATABASE_URL"] == "" && inv.value("postgres-url") == "" {
					t.Error("--kind=postgres without DATABASE_URL or --postgres-url")
				}
				if d := s.DependsOn["postgres"]; d.Condition != "service_healthy" {
					t.Error("the PostgreSQL sink must wait for postgres to be healthy")
				}
			}
		})
	}
	if len(workerIDs) < 2 {
		t.Errorf("%d workers, want two", len(workerIDs))
	}
}

// parseNATSURL returns the host of a nats:// URL.
func parseNATSURL(u string) (string, error) {
	host, _, err := net.SplitHostPort(strings.TrimPrefix(u, "nats://"))
	return host, err
}

// TestDockerfile checks the root Dockerfile for what the deployment files
// rely on: a static binary, a non-root user, the binary as entrypoint, and
// a Go release no older than go.mod asks for.
func TestDockerfile(t *testing.T) {
	t.Parallel()
	df := string(readFile(t, "../Dockerfile"))
	var froms []string
	for _, line := range strings.Split(df, "\n") {
		if f := strings.Fields(line); len(f) >= 2 && strings.EqualFold(f[0], "FROM") {
			froms = append(froms, f[1])
		}
	}
	if len(froms) < 2 {
		t.Fatalf("FROM lines %v: want a multi-stage build", froms)
	}
	if final := froms[len(froms)-1]; !strings.Contains(final, "distroless/static") || !strings.HasSuffix(final, ":nonroot") {
		t.Errorf("final stage %s: want distroless/static:nonroot", final)
	}
	for _, want := range []string{"CGO_ENABLED=0", "./cmd/leasehold", `ENTRYPOINT ["/leasehold"]`, "USER 65532:65532"} {
		if !strings.Contains(df, want) {
			t.Errorf("Dockerfile lacks %s", want)
		}
	}
	goVersion := regexp.MustCompile(`(?m)^ARG GO_VERSION=(\S+)$`).FindStringSubmatch(df)
	modVersion := regexp.MustCompile(`(?m)^go (\S+)$`).FindStringSubmatch(string(readFile(t, "../go.mod")))
	if goVersion == nil || modVersion == nil || !versionAtLeast(goVersion[1], modVersion[1]) {
		t.Errorf("Dockerfile Go %v, go.mod %v: the image must build with at least go.mod's release", goVersion, modVersion)
	}
	ignore := readFile(t, "../.dockerignore")
	for _, want := range []string{".git", "/leasehold"} {
		if !slices.Contains(strings.Split(string(ignore), "\n"), want) {
			t.Errorf(".dockerignore does not leave out %s", want)
		}
	}
}

func versionAtLeast(have, want string) bool {
	h, w := strings.Split(have, "."), strings.Split(want, ".")
	for i := 0; i < len(w); i++ {
		if i >= len(h) {
			return false
		}
		hn, _ := strconv.Atoi(h[i])
		wn, _ := strconv.Atoi(w[i])
		if hn != wn {
			return hn > wn
		}
	}
	return true
}
