/**
 * Writes what the docs take from the code: edgepg-proxy's configuration reference
 * (docs/configuration.md, between its markers) and the systemd environment file
 * (deploy/edgepg-proxy.env), both from proxy/settings.ts's table. `npm run docs`; test/docs.test.ts
 * fails when either differs from what this writes.
 */
import { readFileSync, writeFileSync } from 'node:fs'
import { GROUPS, SETTINGS, flagOf, wrap } from '../proxy/settings'

const root = new URL('../', import.meta.url)
export const REFERENCE_FILE = new URL('docs/configuration.md', root)
export const ENV_FILE = new URL('deploy/edgepg-proxy.env', root)
const START = '<!-- proxy-reference: written by `npm run docs` from proxy/settings.ts -->'
const END = '<!-- end of proxy-reference -->'

const settings = Object.values(SETTINGS)
const groups = Object.keys(GROUPS) as Array<keyof typeof GROUPS>
const inGroup = (g: keyof typeof GROUPS) => settings.filter((s) => s.group === g)
const shownDefault = (s: (typeof settings)[number]) => ('default' in s ? s.default : s.kind === 'switch' ? 'off' : 'none')

/** The reference's tables, a section each. */
export function proxyReference(): string {
  return groups
    .map((g) => [`**${GROUPS[g]}**`, '', '| flag | environment | default | meaning |', '| --- | --- | --- | --- |', ...inGroup(g).map((s) => `| \`${flagOf(s)}\` | \`${s.env}\` | ${shownDefault(s)} | ${s.help.replace(/\|/g, '\\|')} |`)].join('\n'))
    .join('\n\n')
}

/** Set in the file as shipped: what an operator edits first (TLS on 443, metrics apart). */
const EXAMPLE: Record<string, string> = {
  EDGEPG_UPSTREAM: '127.0.0.1:5432',
  EDGEPG_LISTEN: '0.0.0.0:443',
  EDGEPG_ADMIN_LISTEN: '127.0.0.1:9464',
  EDGEPG_CERT: '/etc/edgepg/fullchain.pem',
  EDGEPG_KEY: '/etc/edgepg/key.pem',
}

/** `text` as comment lines of 100 columns at most. */
const comment = (text: string) => wrap(text, 98).map((line) => `# ${line}`).join('\n')

export function environmentFile(): string {
  const head = comment(
    'edgepg-proxy settings for systemd (EnvironmentFile=/etc/edgepg/proxy.env): every variable the proxy reads, each EDGEPG_ and the name of its flag in `edgepg-proxy --help` and docs/configuration.md. A line starting with # is not read: its value is the default, or empty where there is none. Switches take true or false; lists are comma-separated. Passwords never go here (tokens: --passfile).'
  )
  const line = (s: (typeof settings)[number]) => {
    const set = EXAMPLE[s.env]
    const literal = 'default' in s && /^[\w.:-]+$/.test(s.default) ? s.default : s.kind === 'switch' ? 'false' : ''
    return `${comment(`--${s.flag}: ${s.help}`)}\n${set ? `${s.env}=${set}` : `#${s.env}=${literal}`}`
  }
  return `${head}\n${groups.map((g) => `\n# ${GROUPS[g]}\n${inGroup(g).map(line).join('\n')}`).join('\n')}\n`
}

/** docs/configuration.md with its reference as the table makes it. */
export function referencePage(page: string): string {
  const [before, rest] = page.split(START)
  const after = rest?.split(END)[1]
  if (after === undefined) throw new Error(`docs/configuration.md has lost its markers: ${START} … ${END}`)
  return `${before}${START}\n\n${proxyReference()}\n\n${END}${after}`
}

if (import.meta.url === `file://${process.argv[1]}`) {
  writeFileSync(REFERENCE_FILE, referencePage(readFileSync(REFERENCE_FILE, 'utf8')))
  writeFileSync(ENV_FILE, environmentFile())
  console.log('wrote docs/configuration.md and deploy/edgepg-proxy.env')
}
