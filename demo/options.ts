/**
 * `npm start` settings: flags win over environment variables, which win over the defaults.
 *
 *   --port 8000        EDGEPG_DEMO_PORT        the SQL console (and its delayed relays)
 *   --proxy-port 8080  EDGEPG_DEMO_PROXY_PORT  edgepg-proxy
 *   --pg-port 5433     EDGEPG_DEMO_PG_PORT     PostgreSQL
 *   --data .edgepg/data EDGEPG_DEMO_DATA       PostgreSQL's data directory, kept between runs
 *   --verbose          EDGEPG_DEMO_VERBOSE=1   PostgreSQL's log and one line per proxy session
 */
import { resolve } from 'node:path'
import { parseArgs } from 'node:util'

export interface DemoOptions {
  port: number
  proxyPort: number
  pgPort: number
  dataDir: string
  verbose: boolean
}

export const USAGE = `Usage: npm start -- [--port 8000] [--proxy-port 8080] [--pg-port 5433] [--data .edgepg/data] [--verbose]
Each flag also has an environment variable: EDGEPG_DEMO_PORT, EDGEPG_DEMO_PROXY_PORT, EDGEPG_DEMO_PG_PORT,
EDGEPG_DEMO_DATA, EDGEPG_DEMO_VERBOSE=1. Delete the data directory to start afresh.
`

/** What to tell a user whose port is taken: the flag and variable that move it. */
export const PORT_SETTINGS = {
  port: '--port / EDGEPG_DEMO_PORT',
  proxyPort: '--proxy-port / EDGEPG_DEMO_PROXY_PORT',
  pgPort: '--pg-port / EDGEPG_DEMO_PG_PORT',
} as const

export class OptionsError extends Error {}

export function parseOptions(argv: string[], env: NodeJS.ProcessEnv): DemoOptions | 'help' {
  const { values } = parseArgs({
    args: argv,
    options: {
      port: { type: 'string' },
      'proxy-port': { type: 'string' },
      'pg-port': { type: 'string' },
      data: { type: 'string' },
      verbose: { type: 'boolean' },
      help: { type: 'boolean', short: 'h' },
    },
    strict: true,
  })
  if (values.help) return 'help'
  const port = (flag: string, value: string | undefined, fallback: number) => {
    if (value === undefined || value === '') return fallback
    const n = Number(value)
    if (!Number.isInteger(n) || n < 1 || n > 65535) throw new OptionsError(`${flag} must be a port number (1-65535), not ${JSON.stringify(value)}`)
    return n
  }
  return {
    port: port('--port', values.port ?? env.EDGEPG_DEMO_PORT, 8000),
    proxyPort: port('--proxy-port', values['proxy-port'] ?? env.EDGEPG_DEMO_PROXY_PORT, 8080),
    pgPort: port('--pg-port', values['pg-port'] ?? env.EDGEPG_DEMO_PG_PORT, 5433),
    dataDir: resolve(values.data ?? env.EDGEPG_DEMO_DATA ?? '.edgepg/data'),
    verbose: values.verbose ?? /^(1|true|yes)$/i.test(env.EDGEPG_DEMO_VERBOSE ?? ''),
  }
}
