package main

import (
	"fmt"
	"os"
	"slices"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"sigs.k8s.io/yaml"
)

// natsEnv maps connection flags to the environment variables the nats CLI
// and client libraries use, so existing deployments keep their settings.
var natsEnv = map[string]string{
	"nats":     "NATS_URL",
	"user":     "NATS_USER",
	"password": "NATS_PASSWORD",
	"nkey":     "NATS_NKEY",
	"creds":    "NATS_CREDS",
	"tls-cert": "NATS_CERT",
	"tls-key":  "NATS_KEY",
	"tls-ca":   "NATS_CA",
}

// envName is the environment variable that sets flag name.
func envName(name string) string {
	if e, ok := natsEnv[name]; ok {
		return e
	}
	return "LEASEHOLD_" + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))
}

// applySettings fills every flag the command line did not set from the
// environment, then from the config file: flags > environment > file.
func applySettings(cmd *cobra.Command) error {
	file, err := readConfigFile(cmd)
	if err != nil {
		return err
	}
	known := map[string]bool{"config": true}
	var errs []string
	cmd.Flags().VisitAll(func(f *pflag.Flag) {
		known[f.Name] = true
		if f.Changed || f.Name == "config" || f.Name == "help" {
			return
		}
		if v, ok := os.LookupEnv(envName(f.Name)); ok {
			if err := f.Value.Set(v); err != nil {
				errs = append(errs, fmt.Sprintf("%s=%q (for --%s): %v", envName(f.Name), v, f.Name, err))
			}
			return
		}
		if v, ok := file.values[f.Name]; ok {
			if err := setFromFile(f, v); err != nil {
				errs = append(errs, fmt.Sprintf("%s: %s: %v", file.path, f.Name, err))
			}
		}
	})
	for k := range file.values {
		if !known[k] && !file.global[k] {
			errs = append(errs, fmt.Sprintf("%s: unknown setting %q for `leasehold %s` (settings are the long flag names; see `leasehold %s --help`)", file.path, k, cmd.Name(), cmd.Name()))
		}
	}
	if len(errs) > 0 {
		slices.Sort(errs)
		return fmt.Errorf("bad settings:\n  %s", strings.Join(errs, "\n  "))
	}
	return nil
}

func setFromFile(f *pflag.Flag, v any) error {
	if list, ok := v.([]any); ok {
		for _, item := range list {
			if err := f.Value.Set(fmt.Sprint(item)); err != nil {
				return err
			}
		}
		return nil
	}
	return f.Value.Set(fmt.Sprint(v))
}

type configFile struct {
	path   string
	values map[string]any
	global map[string]bool // settings some other command takes
}

func readConfigFile(cmd *cobra.Command) (configFile, error) {
	path, _ := cmd.Flags().GetString("config")
	if path == "" {
		path = os.Getenv("LEASEHOLD_CONFIG")
	}
	cf := configFile{path: path, values: map[string]any{}, global: map[string]bool{}}
	if path == "" {
		return cf, nil
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return cf, fmt.Errorf("read the config file: %w (set --config or LEASEHOLD_CONFIG to a YAML file of flag: value lines)", err)
	}
	if err := yaml.Unmarshal(data, &cf.values); err != nil {
		return cf, fmt.Errorf("config file %s is not valid YAML: %w", path, err)
	}
	// One file may serve several commands: a setting is unknown only if no
	// command takes it.
	for _, c := range cmd.Root().Commands() {
		c.Flags().VisitAll(func(f *pflag.Flag) { cf.global[f.Name] = true })
	}
	return cf, nil
}
