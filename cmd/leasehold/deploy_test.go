package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// The command lines in deploy/ (Kubernetes manifests and the compose file)
// parse with this command's real flags, so a renamed or removed flag breaks
// this test rather than a deployment.
func TestDeployCommandLinesParse(t *testing.T) {
	t.Parallel()
	var lines [][]string
	manifests, _ := filepath.Glob("../../deploy/kubernetes/*.yaml")
	for _, path := range manifests {
		data, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		for _, doc := range bytes.Split(data, []byte("\n---")) {
			var obj struct {
				Spec struct {
					Template struct {
						Spec struct {
							Containers []struct {
								Image string   `json:"image"`
								Args  []string `json:"args"`
							} `json:"containers"`
						} `json:"spec"`
					} `json:"template"`
				} `json:"spec"`
			}
			if err := yaml.Unmarshal(doc, &obj); err != nil {
				t.Fatalf("%s: %v", path, err)
			}
			for _, c := range obj.Spec.Template.Spec.Containers {
				if len(c.Args) > 0 {
					lines = append(lines, c.Args)
				}
			}
		}
	}
	data, err := os.ReadFile("../../deploy/docker-compose.yml")
	if err != nil {
		t.Fatal(err)
	}
	var compose struct {
		Services map[string]struct {
			Image   string `json:"image"`
			Build   any    `json:"build"`
			Command any    `json:"command"`
		} `json:"services"`
	}
	if err := yaml.Unmarshal(data, &compose); err != nil {
		t.Fatal(err)
	}
	for name, svc := range compose.Services {
		cmd, ok := svc.Command.([]any)
		if !ok || svc.Build == nil && !strings.Contains(svc.Image, "leasehold") {
			continue // not the leasehold image
		}
		var args []string
		for _, a := range cmd {
			args = append(args, a.(string))
		}
		if len(args) > 0 && args[0] != "nats-server" {
			lines = append(lines, args)
			_ = name
		}
	}
	if len(lines) < 5 {
		t.Fatalf("found only %d leasehold command lines in deploy/: %v", len(lines), lines)
	}
	for _, args := range lines {
		root := newRoot()
		cmd, rest, err := root.Find(args)
		if err != nil || cmd == root {
			t.Errorf("%v: not a leasehold command: %v", args, err)
			continue
		}
		if err := cmd.ParseFlags(rest); err != nil {
			t.Errorf("%v: %v", args, err)
		}
	}
}
