// pg's own SCRAM and md5 code: the proxy reuses it for upstream authentication, the driver loads SCRAM lazily.
declare module 'pg/lib/crypto/sasl.js' {
  const sasl: {
    startSession(mechanisms: string[], stream?: unknown): { mechanism: string; response: string }
    continueSession(session: unknown, password: string, serverData: string, stream?: unknown): Promise<void>
    finalizeSession(session: unknown, serverData: string): void
  }
  export default sasl
}
declare module 'pg/lib/crypto/utils.js' {
  const utils: { postgresMd5PasswordHash(user: string, password: string, salt: Buffer): Promise<string> }
  export default utils
}
// pg's pgpass package, with a file of the proxy's choosing (proxy/auth/passfile.ts).
declare module 'pgpass/lib/helper.js' {
  import type { Stats } from 'node:fs'
  import type { Readable } from 'node:stream'
  const helper: {
    getFileName(env?: NodeJS.ProcessEnv): string
    usePgPass(stats: Stats, file: string): boolean
    getPassword(connInfo: { host: string; port: string; database: string; user: string }, stream: Readable, cb: (password: string | undefined) => void): void
  }
  export default helper
}
