import { fileURLToPath } from 'node:url'
import * as esbuild from 'esbuild'

const driver = fileURLToPath(new URL('../../dist/index.mjs', import.meta.url))

/**
 * Bundles a Worker as a user's app is (docs/driver.md, "Bundling for the edge"): one ES module for workerd,
 * with `pg` (imported by libraries written for node-postgres) and `edgepg` both the built driver.
 */
export function bundleWorker(entry: string, outfile: string, more: esbuild.BuildOptions = {}) {
  return esbuild.build({
    entryPoints: [entry],
    outfile,
    bundle: true,
    format: 'esm',
    platform: 'browser', // no Node built-in may be needed
    conditions: ['workerd', 'worker', 'browser'],
    target: 'es2022',
    alias: { pg: driver, edgepg: driver },
    logLevel: 'error',
    ...more,
  })
}
